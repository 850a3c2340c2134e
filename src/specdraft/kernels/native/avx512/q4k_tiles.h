/* Q4_K, Q5_K and Q4_0 weights as the file stores them, times int8 activations on AVX-512 VNNI: `q4k_passes` (for
 * `q4k_matmul`, `q5k_matmul`, `q4_0_matmul` and the decoder stack's run kinds 11, 13, 12). The tiles are the AVX2
 * library's (`kernels/q4k_tiles.pack_q4k`, `kernels/q4k_tiles.pack_q4_0`, the layouts in `avx2/q4k_tiles.h`: Q4_K's
 * `QUADS` 4-bit tiles of the codes, each super-block's 6-bit scales and mins, fp16 d and dmin; 4.625 bits a weight),
 * and so is the function: the same int8 activations per 256 inputs, the same exact
 * integer sums I = Σ_g sc_g · Σ q·â and M = Σ_g m_g · Σâ_g, the same float32 steps per super-block
 *   y += (d·a) ⊙ I − (dmin·a) ⊙ M
 * so both levels give the same bits. Here a `QUADS` chunk of 64 bytes is two `vpdpbusd` operands as it stands
 * (dword lane c: row c's four bytes; the low nibbles are inputs 8j .. 8j + 3, the high ones 8j + 4 .. 8j + 7), a
 * group's sum is scaled by its 6-bit scales with one `vpmulld`, and the mins take four `vpdpwssd` per super-block.
 *
 * Q5_K: the same on 5-bit codes (the AVX2 5-bit tiles' bytes). Q4_0: each group's fp16 d, the same int8 activations,
 * per group I = Σ q·â − 8·Σâ and y += (d·a) ⊙ I (`q4_0_block_q8`).
 *
 * Where int8 activations are off, and for a sequence's first token (`prompt_pass`), every product in float32 against
 * the file's exact weights (s = d·sc and o = dmin·m, or s = d and o = 8d, are exact in float32): y += s ⊙ Σ q·x −
 * o ⊙ Σ x per group of 32. Each token alone either way, so a verify pass agrees bit for bit with one-token decoding.
 */
#pragma once

#include "tiles.h"
#include "../shared/stored_layout.h"

#define Q4K_SPAN_BYTES (256 * 1024)  /* int8 activations of one sweep over the rows (they stay in L2) */

/* x [K] bf16 of one token -> â [K] int8 on one scale a per `block` inputs (256: Q8_K's; 32: Q8_0's) [K/block], and
 * each group's Σâ [K/32] (int16): the AVX2 library's `quantize_token_blocks`, element for element. */
static void quantize_token_blocks(const uint16_t *x, int64_t K, int block, int8_t *q, float *scale, int16_t *group_sums) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t s = 0; s < K / block; s++) {
        const uint16_t *xs = x + s * block;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < block / 16; i++) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, bf16x16_to_ps(xs + 16 * i)));
        const float amax = _mm512_reduce_max_ps(m);
        const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int g = 0; g < block / GROUP; g++) {  /* nearest, ties even */
            const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_ps(xs + GROUP * g), inverse));
            const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_ps(xs + GROUP * g + 16), inverse));
            _mm_storeu_si128((__m128i *)(q + s * block + GROUP * g), _mm512_cvtsepi32_epi8(lo));
            _mm_storeu_si128((__m128i *)(q + s * block + GROUP * g + 16), _mm512_cvtsepi32_epi8(hi));
            group_sums[s * (block / GROUP) + g] = (int16_t)_mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
        }
        scale[s] = amax / 127.0f;
    }
}

/* The codes of chunk j of a `QUADS` tile of 16 rows (bits 4: Q4_K's; 5: Q5_K's, the AVX2 5-bit tiles' layout),
 * quads[e] dword lane c: row c's codes of inputs 8j + 4e .. 8j + 4e + 3, a byte each. A 5-bit tile's fifth bits (byte
 * i of its 32-byte vector j / 2 holds them at bit 4·(j % 2) + 2·h + e for byte 32·h + i of the chunk: `int4_layout.
 * _fifth_bit_quads`) reach bit 4 by two shifts of both halves' copies (a 16-bit lane right by that bit, then left by
 * 4: each byte's own bit lands at its bit 4, whatever its neighbour holds) and a mask. */
static inline __attribute__((always_inline)) void kquant_quads(const uint8_t *tile, int chunk, int bits,
                                                              __m512i quads[2]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512((const void *)(tile + 64 * chunk));
    quads[0] = _mm512_and_si512(v, low);
    quads[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (bits == 5) {
        const __m256i high = _mm256_loadu_si256((const __m256i *)(tile + INT4_TILE_BYTES + 32 * (chunk / 2)));
        const __m512i both = _mm512_broadcast_i64x4(high);
        const __m512i fifth = _mm512_set1_epi8(0x10);
        for (int e = 0; e < 2; e++) {
            const int bit = 4 * (chunk % 2) + e;  /* rows 0-7 (the low 32 bytes); rows 8-15: bit + 2 */
            const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16((short)bit), _mm256_set1_epi16((short)(bit + 2)), 1);
            const __m512i moved = _mm512_slli_epi16(_mm512_srlv_epi16(both, counts), 4);
            quads[e] = _mm512_or_si512(quads[e], _mm512_and_si512(moved, fifth));
        }
    }
}

/* A block of 16 rows of Q4_K tiles (Q5_K's: `format`; constants after inlining) against `tokens` tokens on
 * int8 activations: â, a and the group sums from the first token on, K (â), K/256 (a) and K/32 (sums) apart from one
 * token to the next. */
static inline __attribute__((always_inline)) void q4k_block_q8(const uint8_t *codes, const uint8_t *marks,
                                                              const uint16_t *steps, const int8_t *xq,
                                                              const float *act_scale, const int16_t *group_sums,
                                                              int64_t K, int tokens, float *y, int64_t ldy, int ahead,
                                                              int format) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP;
    const int bits = stored_bits(format), tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *mark = marks + s * Q4K_MARK_BYTES;
        __m512i dots[MAX_TOKENS];  /* I of each token, a row a lane */
        for (int gl = 0; gl < Q4K_GROUPS; gl++) {
            const int64_t g = s * Q4K_GROUPS + gl;
            const uint8_t *tile = codes + g * tile_bytes;
            prefetch_ahead(tile, tile_bytes, ahead);
            __m512i quads[8];  /* quads[i]: the codes of inputs 4i .. 4i + 3 of each row */
            for (int j = 0; j < 4; j++) kquant_quads(tile, j, bits, quads + 2 * j);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mark + 16 * gl)));
            for (int t = 0; t < tokens; t++) {
                const int32_t *xw = (const int32_t *)(xq + t * K + g * GROUP);
                __m512i dot = _mm512_setzero_si512();
                for (int i = 0; i < 8; i++) dot = _mm512_dpbusd_epi32(dot, quads[i], _mm512_set1_epi32(xw[i]));
                const __m512i scaled = _mm512_mullo_epi32(dot, sc);
                dots[t] = gl == 0 ? scaled : _mm512_add_epi32(dots[t], scaled);
            }
        }
        __m512i mins[4];  /* pair p: (m of group 2p, m of group 2p + 1) of each row, as int16 */
        for (int p = 0; p < 4; p++)
            mins[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mark + 128 + 32 * p)));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + s * Q4K_STEP_HALFWORDS)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + s * Q4K_STEP_HALFWORDS + 16)));
        for (int t = 0; t < tokens; t++) {
            const int32_t *b = (const int32_t *)(group_sums + t * groups + s * Q4K_GROUPS);  /* pairs of group sums */
            __m512i m = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) m = _mm512_dpwssd_epi32(m, mins[p], _mm512_set1_epi32(b[p]));
            const __m512 a = _mm512_set1_ps(act_scale[t * supers + s]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, a), _mm512_cvtepi32_ps(dots[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, a), _mm512_cvtepi32_ps(m), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* A block of 16 rows of Q4_0 tiles (Q5_0's: `format`; constants after inlining) against `tokens` tokens on int8
 * activations: â, a and the group sums from the first token on, K (â) and K/32 (a, sums) apart from one token to the
 * next. */
static inline __attribute__((always_inline)) void q4_0_block_q8(const uint8_t *codes, const uint16_t *steps,
                                                               const int8_t *xq, const float *act_scale,
                                                               const int16_t *group_sums, int64_t K, int tokens,
                                                               float *y, int64_t ldy, int ahead, int format) {
    const int64_t groups = K / GROUP;
    const int bits = stored_bits(format), tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const int32_t middle = 1 << (bits - 1);  /* w = d·(q − middle) */
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * tile_bytes;
        prefetch_ahead(tile, tile_bytes, ahead);
        __m512i quads[8];  /* quads[i]: the codes of inputs 4i .. 4i + 3 of each row */
        for (int j = 0; j < 4; j++) kquant_quads(tile, j, bits, quads + 2 * j);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + g * Q4_0_STEP_HALFWORDS)));
        for (int t = 0; t < tokens; t++) {
            const int32_t *xw = (const int32_t *)(xq + t * K + g * GROUP);
            __m512i dot = _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) dot = _mm512_dpbusd_epi32(dot, quads[i], _mm512_set1_epi32(xw[i]));
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(middle * group_sums[t * groups + g]));
            const __m512 a = _mm512_set1_ps(act_scale[t * groups + g]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, a), _mm512_cvtepi32_ps(dot), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* A block of 16 rows of tiles in `format` (a constant after inlining) against `tokens` tokens in float32: x
 * [tokens][K] float32 (K apart), each group's Σx [tokens][K/32]. Four chains of products per group (inputs 8j + b,
 * low and high nibble, b even and odd), added in one order. */
static inline __attribute__((always_inline)) void q4k_block_exact(const uint8_t *codes, const uint8_t *marks,
                                                                 const uint16_t *steps, const float *xf,
                                                                 const float *group_x, int64_t K, int tokens, float *y,
                                                                 int64_t ldy, int format) {
    const int64_t groups = K / GROUP;
    const int bits = stored_bits(format), tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    /* a code to float32 by `vpermt2ps`, which reads the low 5 bits of each index: no mask, no conversion */
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values16 = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = codes + g * tile_bytes;
        prefetch_ahead(tile, tile_bytes, PREFETCH_BYTES);
        __m512 s, offset;
        if (stored_per_group(format)) {  /* w = d·(q − 2^(bits − 1)) */
            s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(steps + g * Q4_0_STEP_HALFWORDS)));
            offset = _mm512_mul_ps(s, _mm512_set1_ps((float)(1 << (bits - 1))));
        } else {
            const int64_t super = g / Q4K_GROUPS, gl = g % Q4K_GROUPS;
            const uint8_t *mark = marks + super * Q4K_MARK_BYTES;
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mark + 16 * gl))));
            /* m of group gl: the low (gl even) or high (gl odd) int16 of each row's pair */
            const __m512i pair = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mark + 128 + 32 * (gl / 2))));
            const __m512i m = gl % 2 ? _mm512_srli_epi32(pair, 16) : _mm512_and_si512(pair, _mm512_set1_epi32(0xFFFF));
            const uint16_t *step = steps + super * Q4K_STEP_HALFWORDS;
            s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)step)), sc);
            offset = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(step + 16))), _mm512_cvtepi32_ps(m));
        }
        __m512 chain[MAX_TOKENS][4];
        for (int t = 0; t < tokens; t++) chain[t][0] = chain[t][1] = chain[t][2] = chain[t][3] = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) {
            __m512i quads[2];
            kquant_quads(tile, j, bits, quads);
            for (int b = 0; b < 4; b++) {
                const __m512 lo = _mm512_permutex2var_ps(values, _mm512_srli_epi32(quads[0], 8 * b), values16);
                const __m512 hi = _mm512_permutex2var_ps(values, _mm512_srli_epi32(quads[1], 8 * b), values16);
                for (int t = 0; t < tokens; t++) {
                    const float *xg = xf + t * K + g * GROUP + 8 * j;
                    chain[t][b % 2] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xg[b]), chain[t][b % 2]);
                    chain[t][2 + b % 2] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xg[4 + b]), chain[t][2 + b % 2]);
                }
            }
        }
        for (int t = 0; t < tokens; t++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(chain[t][0], chain[t][1]), _mm512_add_ps(chain[t][2], chain[t][3]));
            acc[t] = _mm512_fmadd_ps(s, sum, acc[t]);
            acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(group_x[t * groups + g]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* x [tokens][K] bf16 -> xf [tokens][K] float32 and each group's Σx [tokens][K/32]: what the float32 paths read. */
static void exact_activations(const uint16_t *x, int64_t K, int tokens, float *xf, float *group_x) {
    const int64_t groups = K / GROUP;
    for (int t = 0; t < tokens; t++)
        for (int64_t g = 0; g < groups; g++) {
            const __m512 lo = bf16x16_to_ps(x + t * K + g * GROUP);
            const __m512 hi = bf16x16_to_ps(x + t * K + g * GROUP + 16);
            _mm512_storeu_ps(xf + t * K + g * GROUP, lo);
            _mm512_storeu_ps(xf + t * K + g * GROUP + 16, hi);
            group_x[t * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}

/* Tokens 0 .. exact − 1 of x in float32 (`q4k_block_exact`), MAX_TOKENS at a time. */
static void q4k_exact_passes(const uint8_t *codes, const uint8_t *marks, const uint16_t *steps, const uint16_t *x,
                             float *y, int64_t N, int64_t K, int64_t exact, int64_t ldy, int format) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP, blocks = N / 16;
    const int tile_bytes = stored_bits(format) == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const int64_t block_steps = stored_block_halfwords(format, K), block_marks = supers * Q4K_MARK_BYTES;
    float *xf = malloc(sizeof(float) * (size_t)(MAX_TOKENS * K));
    float *group_x = malloc(sizeof(float) * (size_t)(MAX_TOKENS * groups));
    for (int64_t t0 = 0; t0 < exact; t0 += MAX_TOKENS) {
        const int chunk = (int)(exact - t0 < MAX_TOKENS ? exact - t0 : MAX_TOKENS);
        exact_activations(x + t0 * K, K, chunk, xf, group_x);
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *block = codes + nb * groups * tile_bytes, *mark = marks ? marks + nb * block_marks : NULL;
            const uint16_t *step = steps + nb * block_steps;
            float *out = y + t0 * ldy + nb * 16;
#define Q4K_EXACT(T) q4k_block_exact(block, mark, step, xf, group_x, K, T, out, ldy, TILES_Q4_K)
#define Q5K_EXACT(T) q4k_block_exact(block, mark, step, xf, group_x, K, T, out, ldy, TILES_Q5_K)
#define Q4_0_EXACT(T) q4k_block_exact(block, mark, step, xf, group_x, K, T, out, ldy, TILES_Q4_0)
#define Q5_0_EXACT(T) q4k_block_exact(block, mark, step, xf, group_x, K, T, out, ldy, TILES_Q5_0)
            if (format == TILES_Q5_K) {
                WITH_CONSTANT_TOKENS(chunk, Q5K_EXACT)
            } else if (format == TILES_Q4_0) {
                WITH_CONSTANT_TOKENS(chunk, Q4_0_EXACT)
            } else if (format == TILES_Q5_0) {
                WITH_CONSTANT_TOKENS(chunk, Q5_0_EXACT)
            } else {
                WITH_CONSTANT_TOKENS(chunk, Q4K_EXACT)
            }
#undef Q4K_EXACT
#undef Q5K_EXACT
#undef Q4_0_EXACT
#undef Q5_0_EXACT
        }
    }
    free(xf);
    free(group_x);
}

/* y [tokens, N] float32 (rows `ldy` apart) = x [tokens, K] bf16 · W^T, W in tiles of `format` (Q4_0: `marks` NULL);
 * K % 256 == 0, N % 16 == 0.
 * The first `precise` tokens in float32 (a sequence's first token, or every token where int8 activations are off:
 * `prompt_pass`), the others on int8 activations: taken in spans whose int8 activations fit in L2; in a span each
 * block of 16 rows meets MAX_TOKENS tokens at a time while its codes stay in L1/L2. */
static void q4k_passes(const uint8_t *codes, const uint8_t *marks, const uint16_t *steps, const uint16_t *x, float *y,
                       int64_t N, int64_t K, int64_t tokens, int64_t ldy, int64_t precise, int format) {
    const int64_t supers = K / Q4K_SUPER, groups = K / GROUP, blocks = N / 16;
    const int tile_bytes = stored_bits(format) == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    const int64_t step_stride = stored_block_halfwords(format, K), mark_stride = supers * Q4K_MARK_BYTES;
    const int per = stored_per_group(format) ? GROUP : Q4K_SUPER;  /* inputs an activation scale covers */
    const int64_t scales = K / per;
    const int64_t fit = Q4K_SPAN_BYTES / K, span = fit < MAX_TOKENS ? MAX_TOKENS : fit - fit % MAX_TOKENS;
    if (precise > tokens) precise = tokens;
    if (precise > 0) q4k_exact_passes(codes, marks, steps, x, y, N, K, precise, ldy, format);
    if (precise == tokens) return;
    int8_t *q = malloc((size_t)(tokens * K));
    float *a = malloc(sizeof(float) * (size_t)(tokens * scales));
    int16_t *sums = malloc(sizeof(int16_t) * (size_t)(tokens * groups));
#pragma omp parallel for schedule(static) if (tokens - precise > 1)
    for (int64_t t = precise; t < tokens; t++) quantize_token_blocks(x + t * K, K, per, q + t * K, a + t * scales, sums + t * groups);
    const int ahead = tokens - precise <= PREFETCH_FAR_TOKENS ? PREFETCH_BYTES : PREFETCH_NEAR_BYTES;
    for (int64_t s0 = precise; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *block = codes + nb * groups * tile_bytes;
            const uint8_t *block_marks = marks ? marks + nb * mark_stride : NULL;  /* Q4_0: none */
            const uint16_t *block_steps = steps + nb * step_stride;
            for (int64_t t0 = s0; t0 < s1; t0 += MAX_TOKENS) {
                const int chunk = (int)(s1 - t0 < MAX_TOKENS ? s1 - t0 : MAX_TOKENS);
                float *out = y + t0 * ldy + nb * 16;
                const int8_t *xq = q + t0 * K;
                const float *scale = a + t0 * scales;
                const int16_t *group_sums = sums + t0 * groups;
#define Q4K_BLOCK(T) q4k_block_q8(block, block_marks, block_steps, xq, scale, group_sums, K, T, out, ldy, ahead, TILES_Q4_K)
#define Q5K_BLOCK(T) q4k_block_q8(block, block_marks, block_steps, xq, scale, group_sums, K, T, out, ldy, ahead, TILES_Q5_K)
#define Q4_0_BLOCK(T) q4_0_block_q8(block, block_steps, xq, scale, group_sums, K, T, out, ldy, ahead, TILES_Q4_0)
#define Q5_0_BLOCK(T) q4_0_block_q8(block, block_steps, xq, scale, group_sums, K, T, out, ldy, ahead, TILES_Q5_0)
                if (format == TILES_Q5_K) {
                    WITH_CONSTANT_TOKENS(chunk, Q5K_BLOCK)
                } else if (format == TILES_Q4_0) {
                    WITH_CONSTANT_TOKENS(chunk, Q4_0_BLOCK)
                } else if (format == TILES_Q5_0) {
                    WITH_CONSTANT_TOKENS(chunk, Q5_0_BLOCK)
                } else {
                    WITH_CONSTANT_TOKENS(chunk, Q4K_BLOCK)
                }
#undef Q4K_BLOCK
#undef Q5K_BLOCK
#undef Q4_0_BLOCK
#undef Q5_0_BLOCK
            }
        }
    }
    free(q);
    free(a);
    free(sums);
}
