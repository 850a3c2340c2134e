/* Prompt passes on int8 activations for CPUs with AVX2 and no AVX-512: the function of `avx512/int8_tiles.h` (the same
 * bits), on `vpmaddubsw` in place of `vpdpbusd`.
 *
 * Numerics (as `avx512/int8_tiles.h`): each token's activations quantized per group of 32 inputs, â = round(x · 127 /
 * max|x|), a = max|x| / 127; the integer sums Σ q·â exact, then scaled in float32 in the same order:
 *   4-bit (w = s·(q − 8) + z):  y += (s·a) ⊙ Σ q·â − (8s − z) ⊙ a·Σâ
 *   5-bit (w = s·(q − 16) + z): the same with 16s − z
 *   Q6_K  (w = d·sc·(q − 32)):  y += (s·a) ⊙ Σ q·â − 32 s ⊙ a·Σâ  per sub-block of 16, s = d·sc
 * Prompt passes use it (`prompt_pass.py`), and on AVX2 every pass by default (one function for decoding and
 * verifying, so speculation stays exact; `SPECDRAFT_INT8_ACTIVATIONS` chooses).
 *
 * `vpmaddubsw` multiplies a code byte (unsigned) by an activation byte (signed) and adds neighbouring products
 * into int16 without saturating here: a 4-bit word is at most 2·15·127 = 3810, so the 8 words of a group sum
 * below 2^15; a 5-bit word at most 2·31·127 = 7874, so a group's are widened four at a time (two chunks); a Q6_K word
 * at most 2·63·127 = 16002, so two are summed before `vpmaddwd` widens them. A vector holds
 * 8 rows (a tile's half), each dword lane the codes of 4 consecutive inputs of one row: 32 multiply-adds an
 * instruction, against 16 for the int16 kernels' `vpmaddwd`.
 *
 * Built with AVX-VNNI (`__AVXVNNI__`: `NumericConfig.avx_vnni`), `vpdpbusd` adds the same four products straight into the
 * int32 lane, one instruction where `vpmaddubsw` + `vpaddw` (+ the widening) took two or three: the integer sums
 * are exact either way, so the bits are the same (measured on a Zen 5, AVX2 forced: every pass width 11-13% faster).
 */
#pragma once

#include "tiles.h"

/* Tokens a sweep over a block of 16 rows takes: Q8_BLOCK (as many as the int16 kernels take, whose sums for 16 rows
 * stay in registers), or a remainder of 5 to Q8_WIDEST in one sweep. A pass of 5 tokens as 4 + 1 unpacked every code
 * twice and paid nearly a one-token pass for its fifth token; one sweep spills a few sums yet costs less (8960x1536,
 * 2 threads, a Zen 5 with AVX2 forced: 5 tokens 0.30 against 0.36 ms, 6 tokens 0.37 against 0.41). From 8 tokens
 * sweeps of 4 stay cheaper (with AVX-VNNI 8 tokens 0.37 against 0.42 ms in one sweep). */
#define Q8_BLOCK MAX_TOKENS
#define Q8_WIDEST (2 * Q8_BLOCK - 1)

/* `call(T)` with T = tokens as a constant (1..Q8_WIDEST). */
#define WITH_CONSTANT_Q8_TOKENS(tokens, call)                                                                     \
    switch (tokens) {                                                                                              \
        case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break;            \
        case 5: call(5); break; case 6: call(6); break; default: call(7); break;                                   \
    }
#define Q8_SPAN_BYTES (256 * 1024)  /* int8 activations of one sweep over the rows */
#define SUMS 3  /* per group: a·Σâ of inputs 0-15, of inputs 16-31 (Q6_K's sub-blocks), and their float sum (4-bit) */

/* x [K] bf16 of one token -> â [K] int8, a [K/32], and `SUMS` sums per group [K/32 · SUMS]. The 4-bit kernel's
 * term, (a·Σâ₀) + (a·Σâ₁), is added here once rather than once per block of rows: the same float addition. */
static void quantize_token(const uint16_t *x, int64_t K, int8_t *q, float *scale, float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < K / GROUP; g++) {
        const uint16_t *xg = x + g * GROUP;
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = bf16x8_to_ps(xg + 8 * i);
        const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        const float amax = hmax8(m);
        const float a = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));  /* nearest, ties even */
        /* int32 -> int8 (|â| <= 127): packs interleave 64-bit lanes, the permute restores order */
        const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);
        const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8));
        scale[g] = a;
        sums[SUMS * g] = a * (float)hsum8_epi32(_mm256_add_epi32(qi[0], qi[1]));
        sums[SUMS * g + 1] = a * (float)hsum8_epi32(_mm256_add_epi32(qi[2], qi[3]));
        sums[SUMS * g + 2] = sums[SUMS * g] + sums[SUMS * g + 1];
    }
}

/* int16 sums of q·â over the quads against one token's activation dwords -> int32 per row. */
static inline __m256i widen16(__m256i words) { return _mm256_madd_epi16(words, _mm256_set1_epi16(1)); }

/* Chunk `chunk` (8 inputs) of a group's tile of a 4-bit (5-bit where `bits` is 5) block of 16 rows against `tokens`
 * tokens, added into their int16 (int32 with AVX-VNNI) sums `words` [token][half]; `first` (a constant after
 * inlining): the chunk whose products start the sums. `x` points at the chunk's activations of the first token, K
 * bytes from one to the next. */
static inline __attribute__((always_inline)) void affine_chunk_q8(const uint8_t *tile, int chunk, int bits,
                                                                 const int8_t *x, int64_t K, int tokens, int first,
                                                                 __m256i words[][2]) {
    __m256i low[2], high[2];  /* the quads of rows 0-7 and 8-15 */
    affine_quads8(tile, chunk, 0, bits, low);
    affine_quads8(tile, chunk, 1, bits, high);
    for (int t = 0; t < tokens; t++)
        for (int j = 0; j < 2; j++) {
            const __m256i x4 = _mm256_set1_epi32(((const int32_t *)(x + t * K))[j]);
#ifdef __AVXVNNI__
            const __m256i start0 = first && j == 0 ? _mm256_setzero_si256() : words[t][0];
            const __m256i start1 = first && j == 0 ? _mm256_setzero_si256() : words[t][1];
            words[t][0] = _mm256_dpbusd_avx_epi32(start0, low[j], x4);
            words[t][1] = _mm256_dpbusd_avx_epi32(start1, high[j], x4);
#else
            const __m256i p0 = _mm256_maddubs_epi16(low[j], x4), p1 = _mm256_maddubs_epi16(high[j], x4);
            words[t][0] = first && j == 0 ? p0 : _mm256_add_epi16(words[t][0], p0);
            words[t][1] = first && j == 0 ? p1 : _mm256_add_epi16(words[t][1], p1);
#endif
        }
}

/* Both halves of a block of 16 rows of a 4-bit (5-bit where `bits` is 5) matrix against `tokens` tokens (constants
 * after inlining): one activation broadcast feeds both halves, and each token's int16 sums stay in registers through
 * a group (5-bit: through two chunks). */
static inline __attribute__((always_inline)) void affine_rows16_q8(const uint8_t *codes, const uint16_t *block_scale,
                                                                  const uint16_t *block_zero, const int8_t *xq,
                                                                  const float *act_scale, const float *sums, int64_t K,
                                                                  int64_t groups, int tokens, float *y, int64_t ldy,
                                                                  int bits) {
    const int tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    __m256 acc[Q8_WIDEST][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_codes = codes + g * tile_bytes;
        const int8_t *xg = xq + g * GROUP;
        prefetch_tile(group_codes, tile_bytes, 0);
        if (g % 2 == 0) {  /* and the scales and offsets, a line (two groups) at a time */
            _mm_prefetch((const char *)(block_scale + g * 16) + PREFETCH_BYTES / 8, _MM_HINT_T0);
            _mm_prefetch((const char *)(block_zero + g * 16) + PREFETCH_BYTES / 8, _MM_HINT_T0);
        }
        __m256i words[Q8_WIDEST][2];
#ifndef __AVXVNNI__
        __m256i first_half[Q8_WIDEST][2];  /* 5-bit: the int32 sums of chunks 0-1 */
#endif
        affine_chunk_q8(group_codes, 0, bits, xg, K, tokens, 1, words);
#pragma GCC unroll 1
        for (int chunk = 1; chunk < 4; chunk++) {
#ifndef __AVXVNNI__
            if (bits == 5 && chunk == 2) {  /* four 5-bit words fill an int16: widen, start again */
                for (int t = 0; t < tokens; t++)
                    for (int h = 0; h < 2; h++) first_half[t][h] = widen16(words[t][h]);
                affine_chunk_q8(group_codes, chunk, bits, xg + 8 * chunk, K, tokens, 1, words);
                continue;
            }
#endif
            affine_chunk_q8(group_codes, chunk, bits, xg + 8 * chunk, K, tokens, 0, words);
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = bf16x8_to_ps(block_scale + g * 16 + h * 8), z = bf16x8_to_ps(block_zero + g * 16 + h * 8);
            const __m256 offset = _mm256_fmsub_ps(s, _mm256_set1_ps(bits == 5 ? 16.0f : 8.0f), z);
            for (int t = 0; t < tokens; t++) {
                const float a = act_scale[t * groups + g], sum = sums[(t * groups + g) * SUMS + 2];
#ifdef __AVXVNNI__
                const __m256i dot = words[t][h];
#else
                const __m256i dot = bits == 5 ? _mm256_add_epi32(first_half[t][h], widen16(words[t][h]))
                                              : widen16(words[t][h]);
#endif
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a)), _mm256_cvtepi32_ps(dot), acc[t][h]);
                acc[t][h] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(sum), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) {
        _mm256_storeu_ps(y + t * ldy, acc[t][0]);
        _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
    }
}

/* Both halves of a block of 16 rows of a Q6_K matrix against `tokens` tokens. */
static inline __attribute__((always_inline)) void q6_rows16_q8(const uint8_t *tiles, const float *d, const int8_t *xq,
                                                              const float *act_scale, const float *sums, int64_t K,
                                                              int64_t groups, int tokens, float *y, int64_t ldy) {
    __m256 acc[Q8_WIDEST][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tiles + g * Q6_TILE_BYTES;
        prefetch_tile(tile, Q6_TILE_BYTES, 0);
        for (int sub = 0; sub < 2; sub++) {  /* inputs 16·sub .. 16·sub + 15: chunks 2·sub, 2·sub + 1 */
            __m256i dots[Q8_WIDEST][2];
            for (int c = 0; c < 2; c++) {
                __m256i low[2], high[2];  /* the quads of rows 0-7 and 8-15 */
                q6_quads8(tile, 2 * sub + c, 0, low);
                q6_quads8(tile, 2 * sub + c, 1, high);
                for (int t = 0; t < tokens; t++) {
                    const int32_t *xs = (const int32_t *)(xq + t * K + g * GROUP + sub * SUB);
                    const __m256i x0 = _mm256_set1_epi32(xs[2 * c]), x1 = _mm256_set1_epi32(xs[2 * c + 1]);
#ifdef __AVXVNNI__
                    if (c == 0) dots[t][0] = dots[t][1] = _mm256_setzero_si256();
                    dots[t][0] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(dots[t][0], low[0], x0), low[1], x1);
                    dots[t][1] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(dots[t][1], high[0], x0), high[1], x1);
#else
                    /* two words of at most 2·63·127 each: no int16 overflow */
                    const __m256i w0 = widen16(_mm256_add_epi16(_mm256_maddubs_epi16(low[0], x0), _mm256_maddubs_epi16(low[1], x1)));
                    const __m256i w1 = widen16(_mm256_add_epi16(_mm256_maddubs_epi16(high[0], x0), _mm256_maddubs_epi16(high[1], x1)));
                    dots[t][0] = c == 0 ? w0 : _mm256_add_epi32(dots[t][0], w0);
                    dots[t][1] = c == 0 ? w1 : _mm256_add_epi32(dots[t][1], w1);
#endif
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 dg = _mm256_loadu_ps(d + (g / 8) * 16 + h * 8);
                const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 384 + sub * 16 + h * 8))));
                const __m256 s = _mm256_mul_ps(sc, dg), offset = _mm256_mul_ps(s, _mm256_set1_ps(32.0f));
                for (int t = 0; t < tokens; t++) {
                    const float a = act_scale[t * groups + g], sum = sums[(t * groups + g) * SUMS + sub];
                    acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a)), _mm256_cvtepi32_ps(dots[t][h]), acc[t][h]);
                    acc[t][h] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(sum), acc[t][h]);
                }
            }
        }
    }
    for (int t = 0; t < tokens; t++) {
        _mm256_storeu_ps(y + t * ldy, acc[t][0]);
        _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
    }
}

/* y [tokens, N] float32 (rows `ldy` apart) for tokens first .. tokens - 1, W as 4-bit tiles (`zero` given; 5-bit where
 * `bits` is 5) or Q6_K tiles (`zero` NULL, `scale` its d). The tokens are taken in spans whose int8 activations fit in
 * L2 (Q8_SPAN_BYTES); in a span each block of 16 rows meets Q8_BLOCK tokens at a time (a last 5 to Q8_WIDEST at once) while its codes
 * stay in L1/L2. */
static void affine_q8_passes(const uint8_t *tiles, const void *scale, const uint16_t *zero, const uint16_t *x, float *y,
                             int64_t N, int64_t K, int64_t first, int64_t tokens, int64_t ldy, int bits) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    const int64_t fit = Q8_SPAN_BYTES / K, span = fit < Q8_BLOCK ? Q8_BLOCK : fit - fit % Q8_BLOCK;
    int8_t *q = malloc((size_t)(tokens * K));
    float *a = malloc(sizeof(float) * (size_t)(tokens * groups)), *sums = malloc(sizeof(float) * (size_t)(tokens * SUMS * groups));
#pragma omp parallel for schedule(static) if (tokens - first > 1)
    for (int64_t t = first; t < tokens; t++) quantize_token(x + t * K, K, q + t * K, a + t * groups, sums + t * SUMS * groups);
    for (int64_t s0 = first; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++)
            for (int64_t t0 = s0, chunk; t0 < s1; t0 += chunk) {
                chunk = s1 - t0 < 2 * Q8_BLOCK ? s1 - t0 : Q8_BLOCK;  /* Q8_BLOCK, or a last sweep of up to Q8_WIDEST */
                const int8_t *xq = q + t0 * K;
                const float *at = a + t0 * groups, *st = sums + t0 * SUMS * groups;
                float *out = y + t0 * ldy + nb * 16;
                if (zero != NULL && bits == 5) {
                    const uint8_t *codes = tiles + nb * groups * INT5_TILE_BYTES;
                    const uint16_t *bs = (const uint16_t *)scale + nb * groups * 16, *bz = zero + nb * groups * 16;
#define INT5_Q8_ROWS(T) affine_rows16_q8(codes, bs, bz, xq, at, st, K, groups, T, out, ldy, 5)
                    WITH_CONSTANT_Q8_TOKENS(chunk, INT5_Q8_ROWS)
#undef INT5_Q8_ROWS
                } else if (zero != NULL) {
                    const uint8_t *codes = tiles + nb * groups * INT4_TILE_BYTES;
                    const uint16_t *bs = (const uint16_t *)scale + nb * groups * 16, *bz = zero + nb * groups * 16;
#define INT4_Q8_ROWS(T) affine_rows16_q8(codes, bs, bz, xq, at, st, K, groups, T, out, ldy, 4)
                    WITH_CONSTANT_Q8_TOKENS(chunk, INT4_Q8_ROWS)
#undef INT4_Q8_ROWS
                } else {
                    const uint8_t *block = tiles + nb * groups * Q6_TILE_BYTES;
                    const float *bd = (const float *)scale + nb * (K / 256) * 16;
#define Q6_Q8_ROWS(T) q6_rows16_q8(block, bd, xq, at, st, K, groups, T, out, ldy)
                    WITH_CONSTANT_Q8_TOKENS(chunk, Q6_Q8_ROWS)
#undef Q6_Q8_ROWS
                }
            }
    }
    free(q);
    free(a);
    free(sums);
}
