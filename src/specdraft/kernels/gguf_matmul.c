/* y = x W^T for a weight kept in its GGUF Q6_K blocks, on AVX-512 with BF16 dot products.
 *
 * x comes in bf16 (the model's activations), each weight code is turned into bf16 exactly by a
 * table lookup (codes are small integers), pairs are multiplied and summed in float32 by
 * `vdpbf16ps`, and the block scales are applied in float32. So the result equals
 * x · dequantized(W) up to float32 summation order. Each block is unpacked once and
 * multiplied into every token of the pass (at most MAX_TOKENS at a time), so a pass of a few
 * tokens costs little more than one. Rows are split across OpenMP threads (the process's
 * runtime: PyTorch's libgomp when torch is loaded first).
 *
 * (Q4_K runs on int4_amx.c where AMX is granted, else on PyTorch's CPU int4 kernel, which
 * measured faster here than a BF16-dot version of this file.)
 * Q6_K super-block (256 weights, 210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high
 *   parts, sixteen int8 scales, fp16 d; w = d·scale_{p/16}·(q − 32), q in 0..63.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 256
#define MAX_TOKENS 8
#define Q6K_BYTES 210

static inline uint16_t bf16_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return (uint16_t)(u >> 16); }

/* bf16 of (i + offset) for i in 0..31: exact for these small integers. */
static inline __m512i bf16_table(int offset) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = bf16_bits((float)(i + offset));
    return _mm512_loadu_si512((const void *)t);
}

/* ----- Q6_K ------------------------------------------------------------------------------ */
/* The 128 codes (q in 0..63) of one half of a Q6_K block, as two vectors: positions 0..63 and
 * 64..127. qh byte i feeds positions i (bits 0-1), 32 + i (2-3), 64 + i (4-5), 96 + i (6-7). */
static inline __attribute__((always_inline)) void q6k_half_codes(const uint8_t *block, int half, __m512i codes[2]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    const __m512i shift_a = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m512i ql = _mm512_loadu_si512((const void *)(block + half * 64));
    __m256i qh32 = _mm256_loadu_si256((const __m256i *)(block + 128 + half * 32));
    __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh32), qh32, 1);
    codes[0] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_a), low2), 4));
    codes[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_b), low2), 4));
}

/* ROWS consecutive rows of W against `tokens` rows of x: the rows share each load of x and keep
 * independent accumulator chains; the rows two steps ahead are prefetched. */
static inline __attribute__((always_inline)) void q6k_rows(const uint8_t *row, int64_t row_bytes, int rows,
                                                          int64_t blocks, const uint16_t *x, int64_t K, int tokens,
                                                          float *out) {
    const __m512i table_low = bf16_table(-32), table_high = bf16_table(0);
    __m512 acc[2][MAX_TOKENS];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tokens; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 scales[2];  /* per row: the 16 sub-block scales of this block */
        for (int r = 0; r < rows; r++) {
            const uint8_t *block = row + r * row_bytes + b * Q6K_BYTES;
            scales[r] = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
                _mm512_set1_ps(_cvtsh_ss(*(const uint16_t *)(block + 208))));
        }
        for (int half = 0; half < 2; half++) {
            __m512i codes[2][2];  /* per row: positions 0..63 and 64..127 of this half, q in 0..63 */
            for (int r = 0; r < rows; r++) {
                const uint8_t *block = row + r * row_bytes + b * Q6K_BYTES;
                const char *ahead = (const char *)(block + 2 * rows * row_bytes + half * 128);
                _mm_prefetch(ahead, _MM_HINT_T0);
                _mm_prefetch(ahead + 64, _MM_HINT_T0);
                q6k_half_codes(block, half, codes[r]);
            }
            for (int c = 0; c < 4; c++) {  /* 32-weight chunks of this half */
                const int chunk = half * 4 + c;  /* sub-blocks 2·chunk (lanes 0-7) and 2·chunk + 1 (lanes 8-15) */
                const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(2 * chunk), _mm256_set1_epi32(2 * chunk + 1), 1);
                __m512i w[2];
                __m512 s[2];
                for (int r = 0; r < rows; r++) {
                    __m256i part = c & 1 ? _mm512_extracti64x4_epi64(codes[r][c >> 1], 1)
                                         : _mm512_castsi512_si256(codes[r][c >> 1]);
                    w[r] = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(part), table_high);
                    s[r] = _mm512_permutexvar_ps(pick, scales[r]);
                }
                for (int t = 0; t < tokens; t++) {
                    const __m512i xv = _mm512_loadu_si512((const void *)(x + t * K + b * QK + chunk * 32));
                    for (int r = 0; r < rows; r++)
                        acc[r][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[r], (__m512bh)xv),
                                                    s[r], acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tokens; t++) out[r * MAX_TOKENS + t] = _mm512_reduce_add_ps(acc[r][t]);
}

/* ----- entry points: y[tokens, N] = x[tokens, K] W^T, W as N rows of K / 256 blocks --------- */
#define DISPATCH(call_with_tokens)                                          \
    switch (chunk) { /* a constant token count per case keeps accumulators in registers */ \
        case 1: call_with_tokens(1); break; case 2: call_with_tokens(2); break;         \
        case 3: call_with_tokens(3); break; case 4: call_with_tokens(4); break;         \
        case 5: call_with_tokens(5); break; case 6: call_with_tokens(6); break;         \
        case 7: call_with_tokens(7); break; default: call_with_tokens(8); break;        \
    }

void q6k_matmul(const uint8_t *w, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    const int64_t blocks = K / QK, row_bytes = blocks * Q6K_BYTES;
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        const int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        const uint16_t *xt = x + t0 * K;
        #pragma omp parallel for schedule(static)
        for (int64_t pair = 0; pair < (N + 1) / 2; pair++) {
            const int64_t n = pair * 2;
            const int rows = n + 1 < N ? 2 : 1;
            float out[2 * MAX_TOKENS];
            const uint8_t *row = w + n * row_bytes;
#define Q6K_CALL(T) (rows == 2 ? q6k_rows(row, row_bytes, 2, blocks, xt, K, T, out) \
                               : q6k_rows(row, row_bytes, 1, blocks, xt, K, T, out))
            DISPATCH(Q6K_CALL)
            for (int r = 0; r < rows; r++)
                for (int t = 0; t < chunk; t++) y[(t0 + t) * N + n + r] = out[r * MAX_TOKENS + t];
        }
    }
}

/* ----- PyTorch's CPU int4 layout, unpacked for wide passes -------------------------------------
 * `_convert_weight_to_int4pack_for_cpu` (N a multiple of 64) stores [N / 64, K, 32] bytes: byte
 * (b, k, j) holds code (row 64b + j, column k) in its low nibble and (row 64b + 32 + j, k) in its
 * high one; a group g of G columns has w = (q − 8) · scale + zero with scales_zeros [K / G, N, 2]
 * (bf16). This writes W^T [K, N] in bf16, so a wide pass is one dense bf16 GEMM (x · W^T), which
 * is far faster on a prefill than the int4 kernel, at the cost of a short-lived bf16 copy. */
static inline __m512 bf16_to_ps(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

void int4pack_to_bf16_t(const uint8_t *packed, const uint16_t *scales_zeros, uint16_t *out_t, int64_t N, int64_t K,
                        int64_t group) {
    const __m512i nibble = _mm512_set1_epi16(0x0F), eight = _mm512_set1_epi16(8);
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    #pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < K; k++) {
        const uint16_t *sz = scales_zeros + (k / group) * N * 2;  /* [N, 2] for this group */
        for (int64_t b = 0; b < N / 64; b++) {
            __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(packed + (b * K + k) * 32)));
            __m512i codes[2] = {_mm512_sub_epi16(_mm512_and_si512(bytes, nibble), eight),   /* rows 64b + 0..31 */
                                _mm512_sub_epi16(_mm512_srli_epi16(bytes, 4), eight)};    /* rows 64b + 32..63 */
            for (int h = 0; h < 2; h++) {
                const uint16_t *pairs = sz + (b * 64 + h * 32) * 2;  /* 32 (scale, zero) pairs */
                __m512i first = _mm512_loadu_si512((const void *)pairs), second = _mm512_loadu_si512((const void *)(pairs + 32));
                __m512i scale = _mm512_permutex2var_epi16(first, even, second), zero = _mm512_permutex2var_epi16(first, odd, second);
                __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(codes[h])));
                __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(codes[h], 1)));
                __m512 w_lo = _mm512_fmadd_ps(q_lo, bf16_to_ps(_mm512_castsi512_si256(scale)), bf16_to_ps(_mm512_castsi512_si256(zero)));
                __m512 w_hi = _mm512_fmadd_ps(q_hi, bf16_to_ps(_mm512_extracti64x4_epi64(scale, 1)),
                                              bf16_to_ps(_mm512_extracti64x4_epi64(zero, 1)));
                _mm512_storeu_si512((void *)(out_t + k * N + b * 64 + h * 32), (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
            }
        }
    }
}

/* ----- Q6_K unpacked to bf16 [N, K], for wide passes (one dense GEMM after) -------------------- */
void q6k_to_bf16(const uint8_t *w, uint16_t *out, int64_t N, int64_t K) {
    const int64_t blocks = K / QK, row_bytes = blocks * Q6K_BYTES;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = w + n * row_bytes + b * Q6K_BYTES;
            const float d = _cvtsh_ss(*(const uint16_t *)(block + 208));
            const int8_t *scales = (const int8_t *)(block + 192);
            uint16_t *dst = out + n * K + b * QK;
            for (int half = 0; half < 2; half++) {
                __m512i codes[2];
                q6k_half_codes(block, half, codes);
                for (int c = 0; c < 8; c++) {  /* 16-weight sub-blocks of this half */
                    const int sub = half * 8 + c;
                    __m128i part = _mm512_extracti32x4_epi32(codes[c >> 2], c & 3);
                    __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(part), _mm512_set1_epi32(32)));
                    __m512 v = _mm512_mul_ps(q, _mm512_set1_ps(d * (float)scales[sub]));
                    _mm256_storeu_si256((__m256i *)(dst + sub * 16), (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
    }
}
