/* Q4_0 weights as the file stores them, times int8 activations: `q4_0_matmul`, and `q4_0_passes` for the decoder
 * stack (run kind 12). The AVX-512 library computes the same function on the same tiles (`avx512/q4_0_tiles.h`); on
 * AMX Q4_0 runs as 4-bit tiles with a bf16 scale and offset per 32 weights (`int4_layout`).
 *
 * Q4_0 keeps, per row and group of 32 weights, an fp16 d: w = d·(q − 8), q in 0..15. The tiles keep exactly that
 * (`kernels/q4_0_tiles.pack_q4_0`, 4.5 bits a weight as in the file, against 5 for the 4-bit tiles):
 *   codes  [N/16][K/32][256]  the `QUADS` 4-bit tile of each group (`int4_layout.quad_tiles`), as Q4_K's
 *   steps  [N/16][K/32][16]   d of each row, fp16 bits
 *
 * Numerics: each token's activations on one int8 scale per 256 inputs (`quantize_token_256`, Q4_K's: â, a and Σâ
 * per group of 32), per group and row the exact integer sum I = Σ q·â − 8·Σâ, then in float32, groups in input order:
 *   y += (d·a) ⊙ I
 * Bounds as Q4_K's: a group's 8 `vpmaddubsw` words sum below 2^15, |8·Σâ| <= 8·32·127. Where int8 activations are
 * off, and for a sequence's first token (`prompt_pass`), the 16-bit tiles' arithmetic on the file's exact weights
 * (`q4_0_half16`). Each token alone either way, so a verify pass agrees bit for bit with one-token decoding.
 */
#pragma once

#include "q4k_tiles.h"

/* A block of 16 rows of Q4_0 tiles against `tokens` tokens (a constant after inlining): â, a and the group sums from
 * the first token on, K (â), K/256 (a) and K/32 (sums) apart from one token to the next. */
static inline __attribute__((always_inline)) void q4_0_rows16(const uint8_t *codes, const uint16_t *steps,
                                                             const int8_t *xq, const float *act_scale,
                                                             const int16_t *group_sums, int64_t K, int tokens,
                                                             float *y, int64_t ldy) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP;
    __m256 acc[Q8_WIDEST][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * INT4_TILE_BYTES;
        const int8_t *xg = xq + g * GROUP;
        prefetch_tile(tile, INT4_TILE_BYTES, 0);
        __m256i words[Q8_WIDEST][2];
        affine_chunk_q8(tile, 0, 4, xg, K, tokens, 1, words);
#pragma GCC unroll 1
        for (int chunk = 1; chunk < 4; chunk++) affine_chunk_q8(tile, chunk, 4, xg + 8 * chunk, K, tokens, 0, words);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + g * Q4_0_STEP_HALFWORDS + 8 * h)));
            for (int t = 0; t < tokens; t++) {
#ifdef __AVXVNNI__
                const __m256i dot = words[t][h];
#else
                const __m256i dot = widen16(words[t][h]);
#endif
                const __m256i sum = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * (int32_t)group_sums[t * groups + g]));
                const __m256 a = _mm256_set1_ps(act_scale[t * supers + g / Q4K_GROUPS]);
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(sum), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) {
        _mm256_storeu_ps(y + t * ldy, acc[t][0]);
        _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
    }
}

/* Half `half` (8 rows) of a block of 16 rows of Q4_0 tiles against `tokens` tokens on the 16-bit tiles' int16
 * activations (`tile_activations`), the file's weights exactly, as `q4k_half16` with s = d and o = 8d. */
static inline __attribute__((always_inline)) void q4_0_half16(const uint8_t *codes, const uint16_t *steps,
                                                             const TileActivations *act, int64_t K, int tokens,
                                                             int half, float *y, int64_t ldy) {
    const int64_t groups = K / GROUP;
    __m256 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * INT4_TILE_BYTES;
        prefetch_tile(tile, INT4_TILE_BYTES, half * 32);
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + g * Q4_0_STEP_HALFWORDS + 8 * half)));
        const __m256 offset = _mm256_mul_ps(s, _mm256_set1_ps(8.0f));  /* exact */
        const int16_t *xg = act->x + g * GROUP;
        for (int part = 0; part < 2; part++) {
            __m256i sum[MAX_TOKENS];
            affine_part_sums(tile, half, 4, xg, K, tokens, part, sum);
            for (int t = 0; t < tokens; t++) {
                const float scale = act->scale[t * 2 * groups + 2 * g + part];
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(scale)), _mm256_cvtepi32_ps(sum[t]), acc[t]);
            }
        }
        for (int t = 0; t < tokens; t++) {
            const float *sums = act->sums + t * 2 * groups + 2 * g;
            acc[t] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(sums[0] + sums[1]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm256_storeu_ps(y + t * ldy + half * 8, acc[t]);
}

/* Tokens 0 .. precise − 1 of x on the 16-bit path (`q4_0_half16`), MAX_TOKENS at a time. */
static void q4_0_passes16(const uint8_t *codes, const uint16_t *steps, const uint16_t *x, float *y, int64_t N,
                          int64_t K, int64_t precise, int64_t ldy) {
    const int64_t groups = K / GROUP, items = 2 * (N / 16);
    for (int64_t t0 = 0; t0 < precise; t0 += MAX_TOKENS) {
        const int chunk = (int)(precise - t0 < MAX_TOKENS ? precise - t0 : MAX_TOKENS);
        const TileActivations act = tile_activations(x + t0 * K, K, chunk);
#pragma omp parallel for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t nb = item / 2;
            const int half = (int)(item % 2);
#define Q4_0_HALF16(T) q4_0_half16(codes + nb * groups * INT4_TILE_BYTES, steps + nb * groups * Q4_0_STEP_HALFWORDS, \
                                   &act, K, T, half, y + t0 * ldy + nb * 16, ldy)
            WITH_CONSTANT_TOKENS(chunk, Q4_0_HALF16)
#undef Q4_0_HALF16
        }
        release_activations(act);
    }
}

/* y [tokens, N] float32 (rows `ldy` apart) = x [tokens, K] bf16 · W^T, W in Q4_0 tiles; K % 256 == 0, N % 16 == 0.
 * The first `precise` tokens on the 16-bit path (a sequence's first token, or every token where int8 activations
 * are off: `prompt_pass`), the others on int8 activations, in spans as `q4k_passes`. */
static void q4_0_passes(const uint8_t *codes, const uint16_t *steps, const uint16_t *x, float *y, int64_t N, int64_t K,
                        int64_t tokens, int64_t ldy, int64_t precise) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP, blocks = N / 16;
    const int64_t fit = Q8_SPAN_BYTES / K, span = fit < Q8_BLOCK ? Q8_BLOCK : fit - fit % Q8_BLOCK;
    if (precise > tokens) precise = tokens;
    q4_0_passes16(codes, steps, x, y, N, K, precise, ldy);
    if (precise == tokens) return;
    int8_t *q = malloc((size_t)(tokens * K));
    float *a = malloc(sizeof(float) * (size_t)(tokens * supers));
    int16_t *sums = malloc(sizeof(int16_t) * (size_t)(tokens * groups));
#pragma omp parallel for schedule(static) if (tokens - precise > 1)
    for (int64_t t = precise; t < tokens; t++) quantize_token_256(x + t * K, K, q + t * K, a + t * supers, sums + t * groups);
    for (int64_t s0 = precise; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *block = codes + nb * groups * INT4_TILE_BYTES;
            const uint16_t *block_steps = steps + nb * groups * Q4_0_STEP_HALFWORDS;
            for (int64_t t0 = s0, chunk; t0 < s1; t0 += chunk) {
                chunk = s1 - t0 < 2 * Q8_BLOCK ? s1 - t0 : Q8_BLOCK;  /* Q8_BLOCK, or a last sweep of up to Q8_WIDEST */
                float *out = y + t0 * ldy + nb * 16;
#define Q4_0_ROWS(T) q4_0_rows16(block, block_steps, q + t0 * K, a + t0 * supers, sums + t0 * groups, K, T, out, ldy)
                WITH_CONSTANT_Q8_TOKENS(chunk, Q4_0_ROWS)
#undef Q4_0_ROWS
            }
        }
    }
    free(q);
    free(a);
    free(sums);
}
