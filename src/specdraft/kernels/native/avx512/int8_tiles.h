/* Prefill kernels: the 4-bit and Q6_K tiles of `avx512/tiles.h` times int8 activations, with AVX-512
 * VNNI integer dot products (`vpdpbusd`: 64 multiply-adds an instruction, against 32 for `vdpbf16ps`).
 *
 * Why: a prompt's pass is compute-bound on the dot products (a 1.5B target, 2 cores: about 4 ms a
 * token in passes of 8), and its time counts in every answer's latency. llama.cpp computes every
 * pass this way (Q8 activations against its 4- and 6-bit blocks).
 *
 * Numerics: each token's activations are quantized per group of 32 inputs, â = round(x · 127 / max|x|),
 * a = max|x| / 127, so x ≈ a·â; the integer sums Σ q·â are exact, then scaled in float32:
 *   4-bit (w = s·(q − 8) + z):  y += (s·a) ⊙ Σ q·â − (8s − z) ⊙ a·Σâ
 *   Q6_K  (w = d·sc·(q − 32)):  y += (s·a) ⊙ Σ q·â − 32 s ⊙ a·Σâ  per sub-block of 16, s = d·sc
 * This is not the 16-bit kernels' function (activations keep about 8 bits, not 15): callers use it
 * only for prompt passes, which plain and speculative decoding run alike, never for the passes
 * whose logits a draft is checked against. Each token is computed alone, in the same order whatever
 * the pass width, so a prompt gives the same bits however it is cut into passes.
 *
 * Weights stay in the tiles' layouts; a tile's codes become `vpdpbusd` operands — lane c (row c of
 * the 16) holds the codes of 4 consecutive inputs as bytes — by a byte shuffle and nibble unpacking,
 * once per pass of up to VNNI_TOKENS tokens.
 */
#pragma once

#include "tiles.h"

#define VNNI_TOKENS 16

/* `call(T)` with T = tokens as a constant (1..VNNI_TOKENS). */
#define WITH_CONSTANT_TOKENS_16(tokens, call)                                                  \
    switch (tokens) {                                                                          \
        case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;                \
        case 4: call(4); break; case 5: call(5); break; case 6: call(6); break;                \
        case 7: call(7); break; case 8: call(8); break; case 9: call(9); break;                \
        case 10: call(10); break; case 11: call(11); break; case 12: call(12); break;          \
        case 13: call(13); break; case 14: call(14); break; case 15: call(15); break;          \
        default: call(16); break;                                                              \
    }

/* x [tokens, K] bf16 -> â [tokens, K] int8, a [tokens, K/32], and a·Σâ per 16 inputs [tokens, K/16]. */
static void quantize_activations(const uint16_t *x, int64_t K, int tokens, int8_t *q, float *scale, float *sums16) {
    const int64_t groups = K / GROUP;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int t = 0; t < tokens; t++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = t * K + g * GROUP;
            const __m512 lo = bf16x16_to_ps(x + at), hi = bf16x16_to_ps(x + at + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
            const float a = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));  /* nearest, ties even */
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
            _mm_storeu_si128((__m128i *)(q + at), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(q + at + 16), _mm512_cvtsepi32_epi8(qhi));
            scale[t * groups + g] = a;
            sums16[t * 2 * groups + 2 * g] = a * (float)_mm512_reduce_add_epi32(qlo);
            sums16[t * 2 * groups + 2 * g + 1] = a * (float)_mm512_reduce_add_epi32(qhi);
        }
}

/* 64 bytes of a 4-bit tile (pairs 4·chunk .. 4·chunk + 3) -> two `vpdpbusd` operands: lane c of quads[h]
 * holds the codes of inputs 8·chunk + 4h .. 8·chunk + 4h + 3 of row c. */
static inline __attribute__((always_inline)) void int4_quads(const uint8_t *bytes, __m512i quads[2]) {
    /* in each 16-byte lane, byte 4·(r % 4) + c % 4 holds pair r of row c: bring pairs r, r + 1 of a row together */
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15));
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_shuffle_epi8(_mm512_loadu_si512((const void *)bytes), order);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    quads[0] = _mm512_unpacklo_epi8(lo, hi);
    quads[1] = _mm512_unpackhi_epi8(lo, hi);
}

/* Code pairs as `nibble_pairs` lays them out -> the two `vpdpbusd` operands of `int4_quads`. */
static inline __attribute__((always_inline)) void pairs_to_quads(const __m512i pairs[2], __m512i quads[2]) {
    quads[0] = _mm512_unpacklo_epi16(pairs[0], _mm512_bsrli_epi128(pairs[0], 8));
    quads[1] = _mm512_unpacklo_epi16(pairs[1], _mm512_bsrli_epi128(pairs[1], 8));
}

/* Σ over 4·n inputs of q·â for one token: `quads[j]` against the activations' dwords j. */
#define DOT_QUADS(dot, quads, n, xq)                                                                 \
    do {                                                                                             \
        dot = _mm512_setzero_si512();                                                                \
        for (int j = 0; j < (n); j++)                                                                \
            dot = _mm512_dpbusd_epi32(dot, quads[j], _mm512_set1_epi32(((const int32_t *)(xq))[j])); \
    } while (0)

/* One block of 16 output rows of a 4-bit matrix against `tokens` tokens (a constant after inlining). */
static inline __attribute__((always_inline)) void int4_block_q8(const uint8_t *codes, const uint16_t *block_scale,
                                                               const uint16_t *block_zero, const int8_t *xq,
                                                               const float *act_scale, const float *sums16, int64_t K,
                                                               int64_t groups, int tokens, float *y, int64_t ldy,
                                                               int ahead, int bits) {
    const int tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    __m512 acc[VNNI_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_codes = codes + g * tile_bytes;
        prefetch_ahead(group_codes, tile_bytes, ahead);
        __m512i quads[8];
        for (int chunk = 0; chunk < 4; chunk++) {
            if (bits == 5) {  /* 5-bit codes (< 128, as `vpdpbusd`'s unsigned operand needs) */
                __m512i pairs[2];
                five_code_pairs(group_codes, chunk, pairs);
                pairs_to_quads(pairs, quads + 2 * chunk);
            } else {
                int4_quads(group_codes + chunk * 64, quads + 2 * chunk);
            }
        }
        const __m512 s = bf16x16_to_ps(block_scale + g * 16), z = bf16x16_to_ps(block_zero + g * 16);
        const __m512 offset = _mm512_fmsub_ps(s, _mm512_set1_ps(bits == 5 ? 16.0f : 8.0f), z);
        for (int t = 0; t < tokens; t++) {
            __m512i dot;
            DOT_QUADS(dot, quads, 8, xq + t * K + g * GROUP);
            const float a = act_scale[t * groups + g], sum = sums16[t * 2 * groups + 2 * g] + sums16[t * 2 * groups + 2 * g + 1];
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(a)), _mm512_cvtepi32_ps(dot), acc[t]);
            acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sum), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* One block of 16 output rows of a Q6_K matrix against `tokens` tokens (a constant after inlining). */
static inline __attribute__((always_inline)) void q6_block_q8(const uint8_t *tiles, const float *d, const int8_t *xq,
                                                             const float *act_scale, const float *sums16, int64_t K,
                                                             int64_t groups, int tokens, float *y, int64_t ldy,
                                                             int ahead) {
    __m512 acc[VNNI_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tiles + g * Q6_TILE_BYTES;
        prefetch_ahead(tile, Q6_TILE_BYTES, ahead);
        const float *dg = d + (g / 8) * 16;
        for (int sub = 0; sub < 2; sub++) {  /* inputs 16·sub .. 16·sub + 15: chunks 2·sub, 2·sub + 1 */
            __m512i quads[4], pairs[2];
            q6_code_pairs(tile, 2 * sub, pairs);
            pairs_to_quads(pairs, quads);
            q6_code_pairs(tile, 2 * sub + 1, pairs);
            pairs_to_quads(pairs, quads + 2);
            const __m512 s = q6_scales(tile, dg, sub), offset = _mm512_mul_ps(s, _mm512_set1_ps(32.0f));
            for (int t = 0; t < tokens; t++) {
                __m512i dot;
                DOT_QUADS(dot, quads, 4, xq + t * K + g * GROUP + sub * SUB);
                const float a = act_scale[t * groups + g], sum = sums16[t * 2 * groups + 2 * g + sub];
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(a)), _mm512_cvtepi32_ps(dot), acc[t]);
                acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sum), acc[t]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* The quantized activations of a whole call: â [tokens, K], a [tokens, K/32], a·Σâ [tokens, K/16]. */
typedef struct {
    int8_t *q;
    float *scale, *sums16;
} QuantizedActivations;

static QuantizedActivations quantized(const uint16_t *x, int64_t K, int64_t tokens) {
    QuantizedActivations act = {malloc((size_t)(tokens * K)), malloc(sizeof(float) * (size_t)(tokens * K / GROUP)),
                                malloc(sizeof(float) * (size_t)(tokens * K / SUB))};
#pragma omp parallel for schedule(static) if (tokens > 1)  /* a decoding step's one token: no parallel region */
    for (int64_t t = 0; t < tokens; t++)
        quantize_activations(x + t * K, K, 1, act.q + t * K, act.scale + t * (K / GROUP), act.sums16 + t * (K / SUB));
    return act;
}

static void release(QuantizedActivations act) {
    free(act.q);
    free(act.scale);
    free(act.sums16);
}

/* y [tokens][ldy] float32 (columns 0 .. N - 1) for tokens first .. tokens - 1, W as 4-bit tiles (`zero` given; 5-bit
 * where `bits` is 5) or Q6_K tiles (`zero` NULL, `scale` its d), passes of up to VNNI_TOKENS tokens. */
static void affine_q8_passes(const uint8_t *tiles, const void *scale, const uint16_t *zero, const uint16_t *x, float *y,
                             int64_t N, int64_t K, int64_t first, int64_t tokens, int64_t ldy, int bits) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    QuantizedActivations act = quantized(x, K, tokens);
    const int ahead = tokens - first <= PREFETCH_FAR_TOKENS ? PREFETCH_BYTES : PREFETCH_NEAR_BYTES;
    for (int64_t t0 = first; t0 < tokens; t0 += VNNI_TOKENS) {
        const int chunk = (int)(tokens - t0 < VNNI_TOKENS ? tokens - t0 : VNNI_TOKENS);
        const int8_t *xq = act.q + t0 * K;
        const float *a = act.scale + t0 * groups, *sums = act.sums16 + t0 * 2 * groups;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            float *out = y + t0 * ldy + nb * 16;
            if (zero != NULL && bits == 5) {
                const uint8_t *codes = tiles + nb * groups * INT5_TILE_BYTES;
                const uint16_t *bs = (const uint16_t *)scale + nb * groups * 16, *bz = zero + nb * groups * 16;
#define INT5_Q8_BLOCK(T) int4_block_q8(codes, bs, bz, xq, a, sums, K, groups, T, out, ldy, ahead, 5)
                WITH_CONSTANT_TOKENS_16(chunk, INT5_Q8_BLOCK)
#undef INT5_Q8_BLOCK
            } else if (zero != NULL) {
                const uint8_t *codes = tiles + nb * groups * INT4_TILE_BYTES;
                const uint16_t *bs = (const uint16_t *)scale + nb * groups * 16, *bz = zero + nb * groups * 16;
#define INT4_Q8_BLOCK(T) int4_block_q8(codes, bs, bz, xq, a, sums, K, groups, T, out, ldy, ahead, 4)
                WITH_CONSTANT_TOKENS_16(chunk, INT4_Q8_BLOCK)
#undef INT4_Q8_BLOCK
            } else {
                const uint8_t *block = tiles + nb * groups * Q6_TILE_BYTES;
                const float *bd = (const float *)scale + nb * (K / 256) * 16;
#define Q6_Q8_BLOCK(T) q6_block_q8(block, bd, xq, a, sums, K, groups, T, out, ldy, ahead)
                WITH_CONSTANT_TOKENS_16(chunk, Q6_Q8_BLOCK)
#undef Q6_Q8_BLOCK
            }
        }
    }
    release(act);
}
