/* Q4_0 weights as the file stores them, times int8 activations on AVX-512 VNNI: `q4_0_matmul`, and `q4_0_passes`
 * for the decoder stack (run kind 12). The tiles are the AVX2 library's (`kernels/q4_0_tiles.pack_q4_0`, the layout
 * in `avx2/q4_0_tiles.h`: the `QUADS` 4-bit tiles of the codes, each group's fp16 d; 4.5 bits a weight), and so is
 * the function: the same int8 activations per 256 inputs (`quantize_token_256`), the same exact integer sums
 * I = Σ q·â − 8·Σâ per group of 32, the same float32 steps per group
 *   y += (d·a) ⊙ I
 * so both levels give the same bits. A `QUADS` chunk of 64 bytes is two `vpdpbusd` operands as it stands (as in
 * `q4k_tiles.h`).
 *
 * Where int8 activations are off, and for a sequence's first token (`prompt_pass`), every product in float32 against
 * the file's exact weights: y += d ⊙ Σ q·x − 8d ⊙ Σ x per group. Each token alone either way, so a verify pass
 * agrees bit for bit with one-token decoding.
 */
#pragma once

#include "q4k_tiles.h"

/* A block of 16 rows of Q4_0 tiles against `tokens` tokens (a constant after inlining) on int8 activations: â, a
 * and the group sums from the first token on, K (â), K/256 (a) and K/32 (sums) apart from one token to the next. */
static inline __attribute__((always_inline)) void q4_0_block_q8(const uint8_t *codes, const uint16_t *steps,
                                                               const int8_t *xq, const float *act_scale,
                                                               const int16_t *group_sums, int64_t K, int tokens,
                                                               float *y, int64_t ldy, int ahead) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP;
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * INT4_TILE_BYTES;
        prefetch_ahead(tile, INT4_TILE_BYTES, ahead);
        __m512i quads[8];  /* quads[i]: the codes of inputs 4i .. 4i + 3 of each row */
        for (int j = 0; j < 4; j++) kquant_quads(tile, j, 4, quads + 2 * j);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + g * Q4_0_STEP_HALFWORDS)));
        for (int t = 0; t < tokens; t++) {
            const int32_t *xw = (const int32_t *)(xq + t * K + g * GROUP);
            __m512i dot = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) dot = _mm512_dpbusd_epi32(dot, quads[i], _mm512_set1_epi32(xw[i]));
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * (int32_t)group_sums[t * groups + g]));
            const __m512 a = _mm512_set1_ps(act_scale[t * supers + g / Q4K_GROUPS]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, a), _mm512_cvtepi32_ps(dot), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* A block of 16 rows of Q4_0 tiles against `tokens` tokens in float32: x [tokens][K] float32 (K apart), each group's
 * Σx [tokens][K/32]. Four chains of products per group, added in one order, as `q4k_block_exact`. */
static inline __attribute__((always_inline)) void q4_0_block_exact(const uint8_t *codes, const uint16_t *steps,
                                                                  const float *xf, const float *group_x, int64_t K,
                                                                  int tokens, float *y, int64_t ldy) {
    const int64_t groups = K / GROUP;
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * INT4_TILE_BYTES;
        prefetch_ahead(tile, INT4_TILE_BYTES, PREFETCH_BYTES);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + g * Q4_0_STEP_HALFWORDS)));
        const __m512 offset = _mm512_mul_ps(d, _mm512_set1_ps(8.0f));  /* exact */
        __m512 chain[MAX_TOKENS][4];
        for (int t = 0; t < tokens; t++) chain[t][0] = chain[t][1] = chain[t][2] = chain[t][3] = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(tile + 64 * j));
            for (int b = 0; b < 4; b++) {
                const __m512 lo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * b), values);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * b + 4), values);
                for (int t = 0; t < tokens; t++) {
                    const float *xg = xf + t * K + g * GROUP + 8 * j;
                    chain[t][b % 2] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xg[b]), chain[t][b % 2]);
                    chain[t][2 + b % 2] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xg[4 + b]), chain[t][2 + b % 2]);
                }
            }
        }
        for (int t = 0; t < tokens; t++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(chain[t][0], chain[t][1]), _mm512_add_ps(chain[t][2], chain[t][3]));
            acc[t] = _mm512_fmadd_ps(d, sum, acc[t]);
            acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(group_x[t * groups + g]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* Tokens 0 .. exact − 1 of x in float32 (`q4_0_block_exact`), MAX_TOKENS at a time. */
static void q4_0_exact_passes(const uint8_t *codes, const uint16_t *steps, const uint16_t *x, float *y, int64_t N,
                              int64_t K, int64_t exact, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    float *xf = malloc(sizeof(float) * (size_t)(MAX_TOKENS * K));
    float *group_x = malloc(sizeof(float) * (size_t)(MAX_TOKENS * groups));
    for (int64_t t0 = 0; t0 < exact; t0 += MAX_TOKENS) {
        const int chunk = (int)(exact - t0 < MAX_TOKENS ? exact - t0 : MAX_TOKENS);
        exact_activations(x + t0 * K, K, chunk, xf, group_x);
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
#define Q4_0_EXACT(T) q4_0_block_exact(codes + nb * groups * INT4_TILE_BYTES, steps + nb * groups * Q4_0_STEP_HALFWORDS, \
                                       xf, group_x, K, T, y + t0 * ldy + nb * 16, ldy)
            WITH_CONSTANT_TOKENS(chunk, Q4_0_EXACT)
#undef Q4_0_EXACT
        }
    }
    free(xf);
    free(group_x);
}

/* y [tokens, N] float32 (rows `ldy` apart) = x [tokens, K] bf16 · W^T, W in Q4_0 tiles; K % 256 == 0, N % 16 == 0.
 * The first `precise` tokens in float32 (a sequence's first token, or every token where int8 activations are off:
 * `prompt_pass`), the others on int8 activations, in spans as `q4k_passes`. */
static void q4_0_passes(const uint8_t *codes, const uint16_t *steps, const uint16_t *x, float *y, int64_t N, int64_t K,
                        int64_t tokens, int64_t ldy, int64_t precise) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP, blocks = N / 16;
    const int64_t fit = Q4K_SPAN_BYTES / K, span = fit < MAX_TOKENS ? MAX_TOKENS : fit - fit % MAX_TOKENS;
    if (precise > tokens) precise = tokens;
    if (precise > 0) q4_0_exact_passes(codes, steps, x, y, N, K, precise, ldy);
    if (precise == tokens) return;
    int8_t *q = malloc((size_t)(tokens * K));
    float *a = malloc(sizeof(float) * (size_t)(tokens * supers));
    int16_t *sums = malloc(sizeof(int16_t) * (size_t)(tokens * groups));
#pragma omp parallel for schedule(static) if (tokens - precise > 1)
    for (int64_t t = precise; t < tokens; t++) quantize_token_256(x + t * K, K, q + t * K, a + t * supers, sums + t * groups);
    const int ahead = tokens - precise <= PREFETCH_FAR_TOKENS ? PREFETCH_BYTES : PREFETCH_NEAR_BYTES;
    for (int64_t s0 = precise; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *block = codes + nb * groups * INT4_TILE_BYTES;
            const uint16_t *block_steps = steps + nb * groups * Q4_0_STEP_HALFWORDS;
            for (int64_t t0 = s0; t0 < s1; t0 += MAX_TOKENS) {
                const int chunk = (int)(s1 - t0 < MAX_TOKENS ? s1 - t0 : MAX_TOKENS);
                float *out = y + t0 * ldy + nb * 16;
#define Q4_0_BLOCK(T) q4_0_block_q8(block, block_steps, q + t0 * K, a + t0 * supers, sums + t0 * groups, K, T, out, \
                                    ldy, ahead)
                WITH_CONSTANT_TOKENS(chunk, Q4_0_BLOCK)
#undef Q4_0_BLOCK
            }
        }
    }
    free(q);
    free(a);
    free(sums);
}
