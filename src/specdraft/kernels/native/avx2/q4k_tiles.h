/* Q4_K, Q5_K and Q4_0 weights as the file stores them, times int8 activations: `q4k_passes` (for `q4k_matmul`,
 * `q5k_matmul`, `q4_0_matmul` and the decoder stack's run kinds 11, 13, 12). The AVX-512 library computes the same
 * functions on the same tiles (`avx512/q4k_tiles.h`); on AMX they run as 4- and 5-bit tiles with a bf16 scale and
 * offset per 32 weights (`int4_layout`).
 *
 * Q4_K keeps, per row and super-block of 256 weights, an fp16 d and dmin and eight 6-bit scales sc and mins m, one per
 * group of 32: w = d·sc·q − dmin·m, q in 0..15. The tiles keep exactly those (`kernels/q4k_tiles.pack_q4k`, 4.625
 * bits a weight, against 5 for the 4-bit tiles and 4.5 in the file):
 *   codes  [N/16][K/32][256]  the `QUADS` 4-bit tile of each group (`int4_layout.quad_tiles`)
 *   marks  [N/16][K/256][256] per super-block: sc [group 8][row 16], then m as [pair p 4][half h 2][row 8][e 2]
 *                             (m of group 2p + e), bytes
 *   steps  [N/16][K/256][32]  per super-block: d [row 16], then dmin [row 16], fp16 bits
 *
 * Numerics (llama.cpp's Q4_K x Q8_K): each token's activations on one int8 scale per 256 inputs, â = round(x · 127 /
 * max|x|), a = max|x| / 127, and Σâ per group of 32 (`b`). Per super-block and row, two exact integer sums,
 *   I = Σ_g sc_g · Σ_{i in g} q_i·â_i      M = Σ_g m_g · b_g
 * then in float32, super-blocks in input order:
 *   y += (d·a) ⊙ I − (dmin·a) ⊙ M
 * One float multiply-add per 256 weights where the 4-bit tiles' int8 pass takes three per 32 (the group's scale
 * times the token's, the product, the offset): the integer work is the same `vpmaddubsw` stream. Bounds: a
 * `vpmaddubsw` word is at most 2·15·127 = 3810, a group's 8 of them sum below 2^15; I below 8·63·2·30480 < 2^25, M
 * below 8·63·4064 < 2^21. Where int8 activations are off, and for a sequence's first token (whose few huge channels
 * one int8 scale per 256 cannot hold: `prompt_pass`), the 16-bit tiles' arithmetic on the file's exact weights
 * (`q4k_half16`). Each token alone either way, so a verify pass agrees bit for bit with one-token decoding.
 *
 * Q5_K: the same on 5-bit codes, its tiles the 5-bit tiles' bytes (the nibbles, then the fifth bits: `int4_layout`),
 * 5.625 bits a weight.
 *
 * Q4_0 keeps, per row and group of 32 weights, an fp16 d: w = d·(q − 8), q in 0..15. Its tiles keep exactly that
 * (`kernels/q4k_tiles.pack_q4_0`, 4.5 bits a weight as in the file, against 5 for the 4-bit tiles):
 *   codes  [N/16][K/32][256]  the `QUADS` 4-bit tile of each group, as Q4_K's
 *   steps  [N/16][K/32][16]   d of each row, fp16 bits
 * on the same int8 activations, per group and row the exact integer sum I = Σ q·â − 8·Σâ (|8·Σâ| <= 8·32·127), then
 * y += (d·a) ⊙ I, groups in input order (`q4_0_rows16`); the 16-bit path with s = d and o = 8d.
 */
#pragma once

#include "int8_tiles.h"
#include "../shared/stored_layout.h"

/* x [K] bf16 of one token -> â [K] int8 on one scale a per `block` inputs (256: Q8_K's; 32: Q8_0's) [K/block], and
 * each group's Σâ [K/32] (int16). */
static void quantize_token_blocks(const uint16_t *x, int64_t K, int block, int8_t *q, float *scale, int16_t *group_sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t s = 0; s < K / block; s++) {
        const uint16_t *xs = x + s * block;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < block / 8; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, bf16x8_to_ps(xs + 8 * i)));
        const float amax = hmax8(m);
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int g = 0; g < block / GROUP; g++) {
            __m256i qi[4];
            for (int i = 0; i < 4; i++)  /* nearest, ties even */
                qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8_to_ps(xs + GROUP * g + 8 * i), inverse));
            /* int32 -> int8 (|â| <= 127): packs interleave 64-bit lanes, the permutes restore order */
            const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);
            const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(q + s * block + GROUP * g),
                                _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8));
            group_sums[s * (block / GROUP) + g] = (int16_t)hsum8_epi32(
                _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
        }
        scale[s] = amax / 127.0f;
    }
}

/* A block of 16 rows of Q4_K tiles (Q5_K's: `format`; constants after inlining) against `tokens` tokens: â, a
 * and the group sums from the first token on, K (â), K/256 (a) and K/32 (sums) apart from one token to the next.
 * 5-bit words fill an int16 in four `vpmaddubsw` sums (2·31·127 each): without AVX-VNNI a group's words are widened
 * after two chunks and again after four, then scaled as int32. */
static inline __attribute__((always_inline)) void q4k_rows16(const uint8_t *codes, const uint8_t *marks,
                                                            const uint16_t *steps, const int8_t *xq,
                                                            const float *act_scale, const int16_t *group_sums,
                                                            int64_t K, int tokens, float *y, int64_t ldy, int format) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP;
    const int bits = stored_bits(format), tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    /* a row's 6-bit scale in both int16 halves of its dword: rows 0-7 (half 0) or 8-15 (half 1) of 16 bytes */
    const __m256i spread[2] = {
        _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                         4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1),
        _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1,
                         12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, -1, 15, -1, 15, -1)};
    __m256 acc[Q8_WIDEST][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *mark = marks + s * Q4K_MARK_BYTES;
        __m256i dots[Q8_WIDEST][2];  /* I of each token and half */
        for (int gl = 0; gl < Q4K_GROUPS; gl++) {
            const int64_t g = s * Q4K_GROUPS + gl;
            const uint8_t *tile = codes + g * tile_bytes;
            const int8_t *xg = xq + g * GROUP;
            prefetch_tile(tile, tile_bytes, 0);
            __m256i words[Q8_WIDEST][2];
#ifndef __AVXVNNI__
            __m256i first_half[Q8_WIDEST][2];  /* 5-bit: the int32 sums of chunks 0-1 */
#endif
            affine_chunk_q8(tile, 0, bits, xg, K, tokens, 1, words);
#pragma GCC unroll 1
            for (int chunk = 1; chunk < 4; chunk++) {
#ifndef __AVXVNNI__
                if (bits == 5 && chunk == 2) {
                    for (int t = 0; t < tokens; t++)
                        for (int h = 0; h < 2; h++) first_half[t][h] = widen16(words[t][h]);
                    affine_chunk_q8(tile, chunk, bits, xg + 8 * chunk, K, tokens, 1, words);
                    continue;
                }
#endif
                affine_chunk_q8(tile, chunk, bits, xg + 8 * chunk, K, tokens, 0, words);
            }
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(mark + 16 * gl)));
            for (int h = 0; h < 2; h++) {
                const __m256i sc_h = _mm256_shuffle_epi8(sc, spread[h]);
                for (int t = 0; t < tokens; t++) {
#ifdef __AVXVNNI__
                    const __m256i scaled = _mm256_mullo_epi32(words[t][h], _mm256_srli_epi32(sc_h, 16));
#else
                    const __m256i scaled = bits == 5
                        ? _mm256_mullo_epi32(_mm256_add_epi32(first_half[t][h], widen16(words[t][h])), _mm256_srli_epi32(sc_h, 16))
                        : _mm256_madd_epi16(words[t][h], sc_h);
#endif
                    dots[t][h] = gl == 0 ? scaled : _mm256_add_epi32(dots[t][h], scaled);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256i mins[4];  /* pair p: (m of group 2p, m of group 2p + 1) of each row, as int16 */
            for (int p = 0; p < 4; p++)
                mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(mark + 128 + 32 * p + 16 * h)));
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + s * Q4K_STEP_HALFWORDS + 8 * h)));
            const __m256 dmin = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(steps + s * Q4K_STEP_HALFWORDS + 16 + 8 * h)));
            for (int t = 0; t < tokens; t++) {
                const int32_t *b = (const int32_t *)(group_sums + t * groups + s * Q4K_GROUPS);  /* pairs of group sums */
                __m256i m = _mm256_madd_epi16(mins[0], _mm256_set1_epi32(b[0]));
                for (int p = 1; p < 4; p++) m = _mm256_add_epi32(m, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(b[p])));
                const __m256 a = _mm256_set1_ps(act_scale[t * supers + s]);
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(dots[t][h]), acc[t][h]);
                acc[t][h] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, a), _mm256_cvtepi32_ps(m), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) {
        _mm256_storeu_ps(y + t * ldy, acc[t][0]);
        _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
    }
}

/* The int32 sums Σ q·â of one group of a block of 16 rows (4- or 5-bit codes: `bits`) for `tokens` tokens, per half.
 * `vpmaddubsw` words hold a 4-bit group in int16 (8 words of at most 2·15·127), a 5-bit one two chunks at a time. */
static inline __attribute__((always_inline)) void group_dots_q8(const uint8_t *tile, int bits, const int8_t *xg,
                                                               int64_t K, int tokens, __m256i dots[][2]) {
    __m256i words[Q8_WIDEST][2];
    affine_chunk_q8(tile, 0, bits, xg, K, tokens, 1, words);
#ifdef __AVXVNNI__
#pragma GCC unroll 1
    for (int chunk = 1; chunk < 4; chunk++) affine_chunk_q8(tile, chunk, bits, xg + 8 * chunk, K, tokens, 0, words);
    for (int t = 0; t < tokens; t++) dots[t][0] = words[t][0], dots[t][1] = words[t][1];
#else
    affine_chunk_q8(tile, 1, bits, xg + 8, K, tokens, 0, words);
    if (bits == 5) {
        for (int t = 0; t < tokens; t++) dots[t][0] = widen16(words[t][0]), dots[t][1] = widen16(words[t][1]);
        affine_chunk_q8(tile, 2, bits, xg + 16, K, tokens, 1, words);
    } else {
        affine_chunk_q8(tile, 2, bits, xg + 16, K, tokens, 0, words);
    }
    affine_chunk_q8(tile, 3, bits, xg + 24, K, tokens, 0, words);
    for (int t = 0; t < tokens; t++)
        for (int h = 0; h < 2; h++)
            dots[t][h] = bits == 5 ? _mm256_add_epi32(dots[t][h], widen16(words[t][h])) : widen16(words[t][h]);
#endif
}

/* A block of 16 rows of Q4_0 tiles (Q5_0's: `format`; constants after inlining) against `tokens` tokens: â, a and
 * the group sums from the first token on, K (â) and K/32 (a, sums) apart from one token to the next. */
static inline __attribute__((always_inline)) void q4_0_rows16(const uint8_t *codes, const uint16_t *steps,
                                                             const int8_t *xq, const float *act_scale,
                                                             const int16_t *group_sums, int64_t K, int tokens,
                                                             float *y, int64_t ldy, int format) {
    const int64_t groups = K / GROUP;
    const int bits = stored_bits(format), tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const int32_t middle = 1 << (bits - 1);  /* w = d·(q − middle) */
    __m256 acc[Q8_WIDEST][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * tile_bytes;
        prefetch_tile(tile, tile_bytes, 0);
        __m256i dots[Q8_WIDEST][2];
        group_dots_q8(tile, bits, xq + g * GROUP, K, tokens, dots);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + g * Q4_0_STEP_HALFWORDS + 8 * h)));
            for (int t = 0; t < tokens; t++) {
                const __m256i sum = _mm256_sub_epi32(dots[t][h], _mm256_set1_epi32(middle * group_sums[t * groups + g]));
                const __m256 a = _mm256_set1_ps(act_scale[t * groups + g]);
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), _mm256_cvtepi32_ps(sum), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) {
        _mm256_storeu_ps(y + t * ldy, acc[t][0]);
        _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
    }
}

/* Half `half` (8 rows) of a block of 16 rows of tiles in `format` against `tokens` tokens on the 16-bit tiles' int16
 * activations (`tile_activations`), the file's weights exactly: per group, s = d·sc and o = dmin·m (Q4_0: s = d and
 * o = 8d) in float32 (exact: an fp16 times a small integer), then as `affine_half`: y += (s·2^e) ⊙ Σ q·x̂ per 16
 * inputs, − o ⊙ S per group. */
static inline __attribute__((always_inline)) void q4k_half16(const uint8_t *codes, const uint8_t *marks,
                                                            const uint16_t *steps, const TileActivations *act,
                                                            int64_t K, int tokens, int half, float *y, int64_t ldy,
                                                            int format) {
    const int64_t groups = K / GROUP;
    const int bits = stored_bits(format), tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const __m128i every_other = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * tile_bytes;
        prefetch_tile(tile, tile_bytes, half * 32);
        __m256 s, offset;
        if (stored_per_group(format)) {  /* w = d·(q − 2^(bits − 1)) */
            s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(steps + g * Q4_0_STEP_HALFWORDS + 8 * half)));
            offset = _mm256_mul_ps(s, _mm256_set1_ps((float)(1 << (bits - 1))));
        } else {
            const int64_t super = g / Q4K_GROUPS, gl = g % Q4K_GROUPS;
            const uint8_t *mark = marks + super * Q4K_MARK_BYTES;
            const uint16_t *step = steps + super * Q4K_STEP_HALFWORDS + 8 * half;
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mark + 16 * gl + 8 * half))));
            /* m of group gl for rows 8·half .. 8·half + 7: bytes e, e + 2, ... of the pair's 16 (e = gl % 2) */
            const __m128i pair = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(mark + 128 + 32 * (gl / 2) + 16 * half)), every_other);
            const __m128i m = gl % 2 ? _mm_srli_si128(pair, 8) : pair;
            s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)step)), sc);
            offset = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(step + 16))),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
        }
        const int16_t *xg = act->x + g * GROUP;
        for (int part = 0; part < 2; part++) {
            __m256i sum[MAX_TOKENS];
            affine_part_sums(tile, half, bits, xg, K, tokens, part, sum);
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

/* Tokens 0 .. precise − 1 of x on the 16-bit path (`q4k_half16`), MAX_TOKENS at a time. */
static void q4k_passes16(const uint8_t *codes, const uint8_t *marks, const uint16_t *steps, const uint16_t *x, float *y,
                         int64_t N, int64_t K, int64_t precise, int64_t ldy, int format) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP, items = 2 * (N / 16);
    const int tile_bytes = stored_bits(format) == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const int64_t step_stride = stored_block_halfwords(format, K), mark_stride = supers * Q4K_MARK_BYTES;
    for (int64_t t0 = 0; t0 < precise; t0 += MAX_TOKENS) {
        const int chunk = (int)(precise - t0 < MAX_TOKENS ? precise - t0 : MAX_TOKENS);
        const TileActivations act = tile_activations(x + t0 * K, K, chunk);
#pragma omp parallel for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t nb = item / 2;
            const int half = (int)(item % 2);
            const uint8_t *block = codes + nb * groups * tile_bytes, *mark = marks ? marks + nb * mark_stride : NULL;
            const uint16_t *step = steps + nb * step_stride;
            float *out = y + t0 * ldy + nb * 16;
#define Q4K_HALF16(T) q4k_half16(block, mark, step, &act, K, T, half, out, ldy, TILES_Q4_K)
#define Q5K_HALF16(T) q4k_half16(block, mark, step, &act, K, T, half, out, ldy, TILES_Q5_K)
#define Q4_0_HALF16(T) q4k_half16(block, mark, step, &act, K, T, half, out, ldy, TILES_Q4_0)
#define Q5_0_HALF16(T) q4k_half16(block, mark, step, &act, K, T, half, out, ldy, TILES_Q5_0)
            if (format == TILES_Q5_K) {
                WITH_CONSTANT_TOKENS(chunk, Q5K_HALF16)
            } else if (format == TILES_Q4_0) {
                WITH_CONSTANT_TOKENS(chunk, Q4_0_HALF16)
            } else if (format == TILES_Q5_0) {
                WITH_CONSTANT_TOKENS(chunk, Q5_0_HALF16)
            } else {
                WITH_CONSTANT_TOKENS(chunk, Q4K_HALF16)
            }
#undef Q4K_HALF16
#undef Q5K_HALF16
#undef Q4_0_HALF16
#undef Q5_0_HALF16
        }
        release_activations(act);
    }
}

/* y [tokens, N] float32 (rows `ldy` apart) = x [tokens, K] bf16 · W^T, W in Q4_K tiles; K % 256 == 0, N % 16 == 0.
 * The first `precise` tokens on the 16-bit path (a sequence's first token, or every token where int8 activations
 * are off: `prompt_pass`), the others on int8 activations: taken in spans whose int8 activations fit in L2; in a
 * span each block of 16 rows meets Q8_BLOCK tokens at a time (a last 5 to Q8_WIDEST at once) while its codes stay in
 * L1/L2, as `affine_q8_passes`. */
static void q4k_passes(const uint8_t *codes, const uint8_t *marks, const uint16_t *steps, const uint16_t *x, float *y,
                       int64_t N, int64_t K, int64_t tokens, int64_t ldy, int64_t precise, int format) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP, blocks = N / 16;
    const int tile_bytes = stored_bits(format) == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const int64_t step_stride = stored_block_halfwords(format, K), mark_stride = supers * Q4K_MARK_BYTES;
    const int per = stored_per_group(format) ? GROUP : Q4K_SUPER;  /* inputs an activation scale covers */
    const int64_t scales = K / per;
    const int64_t fit = Q8_SPAN_BYTES / K, span = fit < Q8_BLOCK ? Q8_BLOCK : fit - fit % Q8_BLOCK;
    if (precise > tokens) precise = tokens;
    q4k_passes16(codes, marks, steps, x, y, N, K, precise, ldy, format);
    if (precise == tokens) return;
    int8_t *q = malloc((size_t)(tokens * K));
    float *a = malloc(sizeof(float) * (size_t)(tokens * scales));
    int16_t *sums = malloc(sizeof(int16_t) * (size_t)(tokens * groups));
#pragma omp parallel for schedule(static) if (tokens - precise > 1)
    for (int64_t t = precise; t < tokens; t++) quantize_token_blocks(x + t * K, K, per, q + t * K, a + t * scales, sums + t * groups);
    for (int64_t s0 = precise; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *block = codes + nb * groups * tile_bytes;
            const uint8_t *block_marks = marks ? marks + nb * mark_stride : NULL;  /* Q4_0: none */
            const uint16_t *block_steps = steps + nb * step_stride;
            for (int64_t t0 = s0, chunk; t0 < s1; t0 += chunk) {
                chunk = s1 - t0 < 2 * Q8_BLOCK ? s1 - t0 : Q8_BLOCK;  /* Q8_BLOCK, or a last sweep of up to Q8_WIDEST */
                float *out = y + t0 * ldy + nb * 16;
                const int8_t *xq = q + t0 * K;
                const float *scale = a + t0 * scales;
                const int16_t *group_sums = sums + t0 * groups;
#define Q4K_ROWS(T) q4k_rows16(block, block_marks, block_steps, xq, scale, group_sums, K, T, out, ldy, TILES_Q4_K)
#define Q5K_ROWS(T) q4k_rows16(block, block_marks, block_steps, xq, scale, group_sums, K, T, out, ldy, TILES_Q5_K)
#define Q4_0_ROWS(T) q4_0_rows16(block, block_steps, xq, scale, group_sums, K, T, out, ldy, TILES_Q4_0)
#define Q5_0_ROWS(T) q4_0_rows16(block, block_steps, xq, scale, group_sums, K, T, out, ldy, TILES_Q5_0)
                if (format == TILES_Q5_K) {
                    WITH_CONSTANT_Q8_TOKENS(chunk, Q5K_ROWS)
                } else if (format == TILES_Q4_0) {
                    WITH_CONSTANT_Q8_TOKENS(chunk, Q4_0_ROWS)
                } else if (format == TILES_Q5_0) {
                    WITH_CONSTANT_Q8_TOKENS(chunk, Q5_0_ROWS)
                } else {
                    WITH_CONSTANT_Q8_TOKENS(chunk, Q4K_ROWS)
                }
#undef Q4K_ROWS
#undef Q5K_ROWS
#undef Q4_0_ROWS
#undef Q5_0_ROWS
            }
        }
    }
    free(q);
    free(a);
    free(sums);
}
