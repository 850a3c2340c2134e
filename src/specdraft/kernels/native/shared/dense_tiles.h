/* Dense float weights as a GGUF file stores them (F16, BF16 or F32) times bf16 activations, in float32: f16_matmul,
 * bf16_matmul, f32_matmul, and `dense_passes` for the decoder stack. Written once on AVX2 + FMA + F16C, which every library's
 * CPU has (the AVX-512 build compiles the same code).
 *
 * Layout (`kernels/dense_matmul.pack_dense`): blocks of 16 rows, each input's 16 weights side by side,
 * [N/16][K][16] elements of the file's format (`DENSE_F16`, `DENSE_BF16`: 2 bytes, `DENSE_F32`: 4): one block's
 * column is two vectors of 8 rows.
 *
 * Numerics: each weight widened to float32 exactly (`vcvtph2ps`; a bf16 weight is a float32's top half), each bf16
 * activation too, so every product is
 * the file's weight times the model's activation; each output sums its products in one float32 FMA chain, in
 * input order. Nothing in that order depends on how many tokens a pass holds, so a verify pass agrees bit for bit
 * with one-token decoding.
 *
 * Sweeps: a pass of several tokens takes a block of 16 rows against up to DENSE_TOKENS tokens at a time (12
 * chains in registers; the last sweep 2 to 6 tokens, never 1); a one-token pass takes DENSE_BLOCKS blocks at once,
 * so that 8 chains hide the FMA's latency. Measured on a 2-core Zen 3 against two chains a row (even and odd inputs)
 * and 2 tokens a sweep, 2048 x 2048 F16 in cache: 128 tokens 58-63 against 43-46 G multiply-adds/s; a 16384 x 2048
 * matrix streamed from memory, 4 tokens 3.7 against 4.8 ms, one token 2.7 against 3.5 ms. */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define DENSE_TOKENS 6
#define DENSE_BLOCKS 4

enum { DENSE_F16 = 0, DENSE_BF16 = 1, DENSE_F32 = 2 };  /* the formats; the decoder's run kinds 6, 7, 8 in order */

static inline int dense_bytes(int format) { return format == DENSE_F32 ? 4 : 2; }

/* 8 rows' weights of one input in `format` as float32. */
static inline __m256 dense_load8(const uint8_t *w, int format) {
    if (format == DENSE_F32) return _mm256_loadu_ps((const float *)w);
    const __m128i words = _mm_loadu_si128((const __m128i *)w);
    if (format == DENSE_F16) return _mm256_cvtph_ps(words);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

/* `blocks` blocks of 16 rows (`stride` bytes apart; 1 where `tokens` > 1) against `tokens` tokens' float32
 * activations x [tokens][K] -> y [tokens][ldy] (16 columns a block), all constants after inlining. */
static inline __attribute__((always_inline)) void dense_sweep(const uint8_t *block, int64_t stride, int blocks,
                                                             int format, const float *x, int64_t K, int tokens,
                                                             float *y, int64_t ldy) {
    const int element = dense_bytes(format);
    __m256 acc[2 * (DENSE_TOKENS > DENSE_BLOCKS ? DENSE_TOKENS : DENSE_BLOCKS)];  /* [block · tokens + token][half] */
    for (int c = 0; c < 2 * blocks * tokens; c++) acc[c] = _mm256_setzero_ps();
    const int64_t column = 16 * element;
    for (int64_t k = 0; k < K; k++)
        for (int b = 0; b < blocks; b++) {
            const uint8_t *w = block + b * stride + k * column;
            if (((k * column) & 63) == 0) _mm_prefetch((const char *)w + 4096, _MM_HINT_T0);
            const __m256 w0 = dense_load8(w, format), w1 = dense_load8(w + 8 * element, format);
            for (int t = 0; t < tokens; t++) {
                const __m256 xk = _mm256_set1_ps(x[t * K + k]);
                acc[2 * (b * tokens + t)] = _mm256_fmadd_ps(w0, xk, acc[2 * (b * tokens + t)]);
                acc[2 * (b * tokens + t) + 1] = _mm256_fmadd_ps(w1, xk, acc[2 * (b * tokens + t) + 1]);
            }
        }
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < tokens; t++) {
            _mm256_storeu_ps(y + t * ldy + b * 16, acc[2 * (b * tokens + t)]);
            _mm256_storeu_ps(y + t * ldy + b * 16 + 8, acc[2 * (b * tokens + t) + 1]);
        }
}

/* One sweep with its format, block count and token count as constants. */
#define DENSE_SWEEP(E, B, T) \
    dense_sweep(tiles + nb * block_bytes, block_bytes, B, E, wide + t0 * K, K, T, y + t0 * ldy + nb * 16, ldy)
/* One sweep of `format` (a variable) with the block and token counts as constants. */
#define DENSE_FORMAT_SWEEP(B, T)                                                                                      \
    if (format == DENSE_F16) DENSE_SWEEP(DENSE_F16, B, T); else if (format == DENSE_BF16) DENSE_SWEEP(DENSE_BF16, B, T); \
    else DENSE_SWEEP(DENSE_F32, B, T)

/* y [tokens][ldy] float32 (N columns) = x [tokens, K] bf16 · Wᵀ, W dense tiles in `format`; N % 16 == 0. */
static void dense_passes(const uint8_t *tiles, int format, const uint16_t *x, float *y, int64_t N, int64_t K,
                         int64_t tokens, int64_t ldy) {
    float *wide = malloc(sizeof(float) * (size_t)(tokens * K));  /* bf16 -> float32: the top half of each word */
    for (int64_t i = 0; i < tokens * K; i++) {
        const union { uint32_t bits; float value; } word = {.bits = (uint32_t)x[i] << 16};
        wide[i] = word.value;
    }
    const int64_t blocks = N / 16, block_bytes = K * 16 * dense_bytes(format);
    if (tokens == 1) {
        const int64_t t0 = 0;
#pragma omp parallel for schedule(static)
        for (int64_t group = 0; group < (blocks + DENSE_BLOCKS - 1) / DENSE_BLOCKS; group++) {
            const int64_t first = group * DENSE_BLOCKS;
            if (blocks - first >= DENSE_BLOCKS) {  /* a whole group at once, else the last blocks one by one */
                const int64_t nb = first;
                DENSE_FORMAT_SWEEP(DENSE_BLOCKS, 1);
            } else
                for (int64_t nb = first; nb < blocks; nb++) { DENSE_FORMAT_SWEEP(1, 1); }
        }
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++)
            for (int64_t t0 = 0; t0 < tokens;) {
                const int64_t left = tokens - t0;  /* sweeps of 6, the last 2 to 6 (never a lone token) */
                const int sweep = left <= DENSE_TOKENS ? (int)left : left - DENSE_TOKENS < 2 ? 4 : DENSE_TOKENS;
                switch (sweep) {
                    case 2: DENSE_FORMAT_SWEEP(1, 2); break; case 3: DENSE_FORMAT_SWEEP(1, 3); break;
                    case 4: DENSE_FORMAT_SWEEP(1, 4); break; case 5: DENSE_FORMAT_SWEEP(1, 5); break;
                    default: DENSE_FORMAT_SWEEP(1, 6);
                }
                t0 += sweep;
            }
    }
    free(wide);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · Wᵀ, W F16 dense tiles. */
void f16_matmul(const uint8_t *tiles, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    dense_passes(tiles, DENSE_F16, x, y, N, K, tokens, N);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · Wᵀ, W BF16 dense tiles. */
void bf16_matmul(const uint8_t *tiles, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    dense_passes(tiles, DENSE_BF16, x, y, N, K, tokens, N);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · Wᵀ, W F32 dense tiles. */
void f32_matmul(const uint8_t *tiles, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    dense_passes(tiles, DENSE_F32, x, y, N, K, tokens, N);
}
