/* y = x W^T for weights kept in their GGUF blocks (Q4_K, Q6_K), on AVX-512 with BF16 dot products.
 *
 * x comes in bf16 (the model's activations), each weight code is turned into bf16 exactly by a
 * table lookup (codes are small integers), pairs are multiplied and summed in float32 by
 * `vdpbf16ps`, and the block scales are applied in float32. So the result equals
 * x · dequantized(W) up to float32 summation order. Each block is unpacked once and
 * multiplied into every token of the pass (at most MAX_TOKENS at a time), so a pass of a few
 * tokens costs little more than one. Rows are split across OpenMP threads (the process's
 * runtime: PyTorch's libgomp when torch is loaded first).
 *
 * Q4_K super-block (256 weights, 144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit
 *   scales and mins, 128 bytes of 4-bit codes; sub-block j (32 weights) is
 *   w = d·sc_j·q − dmin·m_j. Bytes 32p..32p+31 hold sub-block 2p (low nibbles) and 2p+1 (high).
 * Q6_K super-block (256 weights, 210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high
 *   parts, sixteen int8 scales, fp16 d; w = d·scale_{p/16}·(q − 32), q in 0..63.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 256
#define MAX_TOKENS 8
#define Q4K_BYTES 144
#define Q6K_BYTES 210

static inline uint16_t bf16_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return (uint16_t)(u >> 16); }

/* bf16 of (i + offset) for i in 0..31: exact for these small integers. */
static inline __m512i bf16_table(int offset) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = bf16_bits((float)(i + offset));
    return _mm512_loadu_si512((const void *)t);
}

static inline __m512 dot32(__m512i w_bf16, const uint16_t *x) {
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w_bf16, (__m512bh)_mm512_loadu_si512((const void *)x));
}

/* ----- Q4_K ------------------------------------------------------------------------------ */
static inline void q4k_scales(const uint8_t *s, float d, float dmin, float *scale, float *minimum) {
    for (int j = 0; j < 4; j++) {
        scale[j] = d * (float)(s[j] & 63);
        minimum[j] = dmin * (float)(s[j + 4] & 63);
        scale[j + 4] = d * (float)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        minimum[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

static inline __attribute__((always_inline)) void q4k_row(const uint8_t *row, int64_t blocks, const uint16_t *x,
                                                         const float *xsum, int64_t K, int tokens, float *out) {
    const __m512i table = bf16_table(0), nibble = _mm512_set1_epi16(0x0F);
    __m512 acc[MAX_TOKENS];
    float offset[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) { acc[t] = _mm512_setzero_ps(); offset[t] = 0.0f; }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * Q4K_BYTES;
        float scale[8], minimum[8];
        q4k_scales(block + 4, _cvtsh_ss(*(const uint16_t *)block), _cvtsh_ss(*(const uint16_t *)(block + 2)),
                   scale, minimum);
        for (int p = 0; p < 4; p++) {
            __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 16 + p * 32)));
            __m512i low = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, nibble), table);
            __m512i high = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
            const __m512 s_low = _mm512_set1_ps(scale[2 * p]), s_high = _mm512_set1_ps(scale[2 * p + 1]);
            for (int t = 0; t < tokens; t++) {
                const uint16_t *xs = x + t * K + b * QK + p * 64;
                acc[t] = _mm512_fmadd_ps(dot32(low, xs), s_low, acc[t]);
                acc[t] = _mm512_fmadd_ps(dot32(high, xs + 32), s_high, acc[t]);
            }
        }
        for (int t = 0; t < tokens; t++) {
            const float *sums = xsum + t * (K / 32) + b * 8;
            for (int j = 0; j < 8; j++) offset[t] += minimum[j] * sums[j];
        }
    }
    for (int t = 0; t < tokens; t++) out[t] = _mm512_reduce_add_ps(acc[t]) - offset[t];
}

/* ----- Q6_K ------------------------------------------------------------------------------ */
static inline __attribute__((always_inline)) void q6k_row(const uint8_t *row, int64_t blocks, const uint16_t *x,
                                                         int64_t K, int tokens, float *out) {
    const __m512i table_low = bf16_table(-32), table_high = bf16_table(0);
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    /* qh byte i feeds positions i (bits 0-1), 32 + i (2-3), 64 + i (4-5), 96 + i (6-7) of its half. */
    const __m512i shift_a = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * Q6K_BYTES;
        const __m512 scales = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
            _mm512_set1_ps(_cvtsh_ss(*(const uint16_t *)(block + 208))));  /* 16 sub-block scales */
        for (int half = 0; half < 2; half++) {
            __m512i ql = _mm512_loadu_si512((const void *)(block + half * 64));
            __m256i qh32 = _mm256_loadu_si256((const __m256i *)(block + 128 + half * 32));
            __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh32), qh32, 1);
            __m512i codes[2];  /* positions 0..63 and 64..127 of this half, q in 0..63 */
            codes[0] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_a), low2), 4));
            codes[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_b), low2), 4));
            for (int c = 0; c < 4; c++) {  /* 32-weight chunks of this half */
                __m256i part = c & 1 ? _mm512_extracti64x4_epi64(codes[c >> 1], 1) : _mm512_castsi512_si256(codes[c >> 1]);
                __m512i w = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(part), table_high);
                const int chunk = half * 4 + c;  /* sub-blocks 2·chunk (lanes 0-7) and 2·chunk + 1 (lanes 8-15) */
                const __m512 s = _mm512_permutexvar_ps(
                    _mm512_inserti64x4(_mm512_set1_epi32(2 * chunk), _mm256_set1_epi32(2 * chunk + 1), 1), scales);
                for (int t = 0; t < tokens; t++)
                    acc[t] = _mm512_fmadd_ps(dot32(w, x + t * K + b * QK + chunk * 32), s, acc[t]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}

/* ----- entry points: y[tokens, N] = x[tokens, K] W^T, W as N rows of K / 256 blocks --------- */
#define DISPATCH(call_with_tokens)                                          \
    switch (chunk) { /* a constant token count per case keeps accumulators in registers */ \
        case 1: call_with_tokens(1); break; case 2: call_with_tokens(2); break;         \
        case 3: call_with_tokens(3); break; case 4: call_with_tokens(4); break;         \
        case 5: call_with_tokens(5); break; case 6: call_with_tokens(6); break;         \
        case 7: call_with_tokens(7); break; default: call_with_tokens(8); break;        \
    }

void q4k_matmul(const uint8_t *w, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    const int64_t blocks = K / QK, row_bytes = blocks * Q4K_BYTES, groups = K / 32;
    float xsum[MAX_TOKENS * groups];  /* per token, the sum of each 32-group of x (for the mins) */
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        const int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        const uint16_t *xt = x + t0 * K;
        for (int t = 0; t < chunk; t++)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int i = 0; i < 32; i++) {
                    uint32_t u = (uint32_t)xt[t * K + g * 32 + i] << 16; float v; memcpy(&v, &u, 4); s += v;
                }
                xsum[t * groups + g] = s;
            }
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float out[MAX_TOKENS];
            const uint8_t *row = w + n * row_bytes;
#define Q4K_CALL(T) q4k_row(row, blocks, xt, xsum, K, T, out)
            DISPATCH(Q4K_CALL)
            for (int t = 0; t < chunk; t++) y[(t0 + t) * N + n] = out[t];
        }
    }
}

void q6k_matmul(const uint8_t *w, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    const int64_t blocks = K / QK, row_bytes = blocks * Q6K_BYTES;
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        const int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        const uint16_t *xt = x + t0 * K;
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float out[MAX_TOKENS];
            const uint8_t *row = w + n * row_bytes;
#define Q6K_CALL(T) q6k_row(row, blocks, xt, K, T, out)
            DISPATCH(Q6K_CALL)
            for (int t = 0; t < chunk; t++) y[(t0 + t) * N + n] = out[t];
        }
    }
}
