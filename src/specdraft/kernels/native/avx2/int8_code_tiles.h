/* Weights that are int8 values times a step per 32, as the file stores them, times bf16 activations: Q8_0 (int8
 * codes, an fp16 step d: w = d·q) and IQ4_NL / IQ4_XS (4-bit indices into llama.cpp's 16 int8 values, a float32 step:
 * IQ4_NL's d, IQ4_XS's d·(scale − 32)). `q8_0_matmul`, `iq4_matmul`, and `code_passes` for the decoder stack (run
 * kinds 9 and 10). The AVX-512 library computes the same function on the same tiles (`avx512/int8_code_tiles.h`); on
 * AMX the loader splits these codes into two 4-bit halves (`SplitInt4Linear`).
 *
 * Layout (`kernels/int8_codes.pack_codes`): tiles of 8 rows x 32 inputs, [N/8][K/32][tile], so that a block of 8 rows
 * streams as one run of memory. A "pair step" (chunk j: inputs 8j .. 8j + 7; pair b < 4) holds, for each row c, the
 * codes of inputs 8j + b and 8j + 4 + b in bytes 2c and 2c + 1 of 16; widened by `vpmovsxbw` they are the int16 code
 * pairs of `quads_to_pair_rows8` (`tiles.h`), which meet the activations `tile_activations` puts in the same order.
 *   Q8_0: 256 bytes, pair step (j, b) at 64·j + 16·b; steps [N/8][K/32][8] fp16 (the file's d, bit for bit).
 *   IQ4: 128 bytes, the 16 bytes at 32·j + 16·p hold pair step (j, 2p) in their low nibbles and (j, 2p + 1) in their
 *        high ones, as indices that `vpshufb` looks up in the table; steps [N/8][K/32][8] float32.
 *
 * Numerics: the arithmetic of the 16-bit tiles (`tiles.h`): each token's activations on an int16 grid per 16 inputs,
 * x = 2^e · x̂, exact integer sums Σ q·x̂ per 16 inputs (at most 16 · 2^15 · 128 = 2^26), then in float32
 *   y += (step·2^e) ⊙ Σ q·x̂
 * per 16 inputs in input order. The same on every pass (no int8 pass: `vpmaddubsw` would need codes and activations
 * split by sign, as many instructions as `vpmaddwd` here), so a verify pass agrees bit for bit with one-token
 * decoding, and the target runs the file's own weights: 8.5 bits a weight for Q8_0, 5 for IQ4 (two 4-bit halves
 * take 10).
 */
#pragma once

#include "tiles.h"
#include "../shared/stored_layout.h"

/* The four pair steps of chunk `chunk` of a tile, as int16 code pairs (`rows[b]`: pair b). */
static inline __attribute__((always_inline)) void code_pairs(const uint8_t *tile, int chunk, int format,
                                                            __m256i rows[4]) {
    if (format == CODES_Q8_0) {
        for (int b = 0; b < 4; b++) rows[b] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tile + 64 * chunk + 16 * b)));
        return;
    }
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES), low = _mm_set1_epi8(0x0F);
    for (int p = 0; p < 2; p++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(tile + 32 * chunk + 16 * p));
        rows[2 * p] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(v, low)));
        rows[2 * p + 1] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low)));
    }
}

/* A block of 8 output rows of code tiles in `format` against `tokens` tokens (constants after inlining), the
 * activations from token `first` of `act` on. */
static inline __attribute__((always_inline)) void code_rows8(const uint8_t *tiles, const void *steps, int format,
                                                            const TileActivations *act, int64_t first, int64_t K,
                                                            int64_t groups, int tokens, float *y, int64_t ldy) {
    const int tile_bytes = format == CODES_Q8_0 ? Q8_0_TILE_BYTES : IQ4_TILE_BYTES;
    __m256 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tiles + g * tile_bytes;
        prefetch_tile(tile, tile_bytes, 0);
        const __m256 step = format == CODES_Q8_0
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)steps + g * 8)))
            : _mm256_loadu_ps((const float *)steps + g * 8);
        const int16_t *xg = act->x + first * K + g * GROUP;
        for (int part = 0; part < 2; part++) {  /* inputs 16·part .. 16·part + 15: chunks 2·part, 2·part + 1 */
            __m256i sum[MAX_TOKENS];
            for (int t = 0; t < tokens; t++) sum[t] = _mm256_setzero_si256();
            for (int chunk = 2 * part; chunk < 2 * part + 2; chunk++) {
                __m256i rows[4];
                code_pairs(tile, chunk, format, rows);
                for (int b = 0; b < 4; b++)
                    for (int t = 0; t < tokens; t++) {  /* x̂ in pair order: the dword is (x̂[8·chunk + b], x̂[8·chunk + 4 + b]) */
                        const int32_t *xp = (const int32_t *)(xg + t * K + 8 * chunk + 2 * b);
                        sum[t] = DOT(sum[t], rows[b], _mm256_set1_epi32(xp[0]));
                    }
            }
            for (int t = 0; t < tokens; t++) {
                const float scale = act->scale[(first + t) * 2 * groups + 2 * g + part];
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(step, _mm256_set1_ps(scale)), _mm256_cvtepi32_ps(sum[t]), acc[t]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) _mm256_storeu_ps(y + t * ldy, acc[t]);
}

/* y [tokens, N] float32 (rows `ldy` apart) = x [tokens, K] bf16 · W^T, W in code tiles of `format` (`steps` fp16 for
 * Q8_0, float32 for IQ4); K % 32 == 0, N % 8 == 0. The tokens are taken in spans whose activations fit in L2; in a
 * span each block of 8 rows meets MAX_TOKENS tokens at a time while its codes stay in L1/L2. */
static void code_passes(const uint8_t *tiles, const void *steps, int format, const uint16_t *x, float *y, int64_t N,
                        int64_t K, int64_t tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 8;
    const int tile_bytes = format == CODES_Q8_0 ? Q8_0_TILE_BYTES : IQ4_TILE_BYTES;
    const int step_bytes = format == CODES_Q8_0 ? 2 : 4;
    const int64_t fit = CODE_SPAN_BYTES / (2 * K), span = fit < MAX_TOKENS ? MAX_TOKENS : fit - fit % MAX_TOKENS;
    const TileActivations act = tile_activations(x, K, (int)tokens);
    for (int64_t s0 = 0; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *block = tiles + nb * groups * tile_bytes;
            const void *block_steps = (const uint8_t *)steps + nb * groups * 8 * step_bytes;
            for (int64_t t0 = s0; t0 < s1; t0 += MAX_TOKENS) {
                const int chunk = (int)(s1 - t0 < MAX_TOKENS ? s1 - t0 : MAX_TOKENS);
                float *out = y + t0 * ldy + nb * 8;
                if (format == CODES_Q8_0) {
#define Q8_0_ROWS(T) code_rows8(block, block_steps, CODES_Q8_0, &act, t0, K, groups, T, out, ldy)
                    WITH_CONSTANT_TOKENS(chunk, Q8_0_ROWS)
#undef Q8_0_ROWS
                } else {
#define IQ4_ROWS(T) code_rows8(block, block_steps, CODES_IQ4, &act, t0, K, groups, T, out, ldy)
                    WITH_CONSTANT_TOKENS(chunk, IQ4_ROWS)
#undef IQ4_ROWS
                }
            }
        }
    }
    release_activations(act);
}
