/* AVX2 kernels for weights kept in 4-, 5- and 6-bit tiles: y = x W^T without unpacking W to float,
 * for x86-64 CPUs without AVX-512 (AMD before Zen 4, most Intel desktops and laptops).
 *
 * 4-bit, 5-bit and Q6_K tiles in the `QUADS` layout (`int4_layout.py`, `gguf_matmul.pack_q6k`: their own, which the
 * int8 kernels of `avx2/int8_tiles.h` unpack with masks and shifts alone), and the same arithmetic as the AVX-512 kernels'
 * int16 flavour (`avx512/tiles.h`): each token's 16 inputs at a time on an
 * int16 grid x = 2^e · x̂ (max|x̂| in [2^14, 2^15)), exact integer sums Σ q·x̂, then the scales in
 * float32 in the same order:
 *   4-bit (w = s·(q − 8) + z, groups of 32):  y += (s·2^e₀) ⊙ Σ₀ q·x̂ + (s·2^e₁) ⊙ Σ₁ q·x̂ − (8 s − z) ⊙ S
 *   5-bit (w = s·(q − 16) + z): the same with 16 s − z
 *   Q6_K  (w = d·sc·(q − 32), sub-blocks of 16): y += (s·2^e) ⊙ Σ q·x̂ − 32 s ⊙ S,  s = d·sc
 * so every output is bit for bit what the AVX-512 int16 build gives (tested where both run).
 *
 * The dot product is `vpmaddwd` (two int16 products summed into an int32) plus `vpaddd`: the
 * integer sums are exact, whatever their order, so one chain per half-group or sub-block suffices.
 * A 256-bit vector holds 8 output rows, so a tile of 16 rows is taken as two halves of 8; the
 * halves are separate work items (each reads its 32 bytes of every 64 of the tile). With 16
 * vector registers, a pass takes MAX_TOKENS = 4 tokens at a time: 4 float accumulators, 4
 * integer sums and 4 unpacked code vectors stay in registers.
 *
 * Each token is computed alone, in an order that does not depend on the pass width, so a verify
 * pass agrees bit for bit with one-token decoding. Rows are split across OpenMP threads.
 */
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vectors.h"

#define GROUP 32
#define SUB 16
#define MAX_TOKENS 4
#define INT4_TILE_BYTES 256
#define INT5_TILE_BYTES 320
#define Q6_TILE_BYTES 416
/* Codes are fetched this far ahead. One-token passes stream the weights once: at 4 KB an 8960 x 1536 matrix was read
 * at 46-64 GB/s where the memory streamed 89; at 8 KB the bundled target's one-token pass ran 11-22% faster and the
 * draft's 10% (a Zen 5 with AVX2 forced, 2 threads, alternating processes), 2 tokens 5%, 3 tokens the same. */
#define PREFETCH_BYTES 8192

/* Token activations as int16 with a power of two per 16 inputs: x [tokens, K] bf16 -> x̂ [tokens, K],
 * 2^e and S = Σ x (exact), both per 16 inputs [tokens, K/16]. Each 8 inputs of x̂ are stored in the order
 * 0, 4, 1, 5, 2, 6, 3, 7: the code pairs of `quads_to_pair_rows8`. */
typedef struct {
    int16_t *x;
    float *scale, *sums;
} TileActivations;

static TileActivations tile_activations(const uint16_t *x, int64_t K, int tokens) {
    const int64_t parts = K / SUB;
    TileActivations act = {malloc(sizeof(int16_t) * (size_t)(tokens * K)), malloc(sizeof(float) * (size_t)(tokens * parts)),
                           malloc(sizeof(float) * (size_t)(tokens * parts))};
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i pair_order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                                0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t i = 0; i < tokens * parts; i++) {
        const __m256 lo = bf16x8_to_ps(x + i * SUB), hi = bf16x8_to_ps(x + i * SUB + 8);
        const float amax = hmax8(_mm256_max_ps(_mm256_andnot_ps(sign, lo), _mm256_andnot_ps(sign, hi)));
        /* e = floor(log2 max|x|) − 14, so that max|x| / 2^e lies in [2^14, 2^15) */
        const int e = amax > 0.0f ? ilogbf(amax) - 14 : 0;
        __m256i q_lo, q_hi;
        if (e >= -126 && e <= 127) {  /* 2^-e is a normal float: the product is exact (a scaling by a power of two) */
            const __m256 factor = _mm256_set1_ps(ldexpf(1.0f, -e));
            q_lo = _mm256_cvtps_epi32(_mm256_mul_ps(lo, factor));  /* nearest, ties even */
            q_hi = _mm256_cvtps_epi32(_mm256_mul_ps(hi, factor));
        } else {  /* activations below 2^-112: scaled one at a time */
            float scaled[16];
            _mm256_storeu_ps(scaled, lo);
            _mm256_storeu_ps(scaled + 8, hi);
            for (int j = 0; j < 16; j++) scaled[j] = ldexpf(scaled[j], -e);
            q_lo = _mm256_cvtps_epi32(_mm256_loadu_ps(scaled));
            q_hi = _mm256_cvtps_epi32(_mm256_loadu_ps(scaled + 8));
        }
        /* int32 -> int16 (|x̂| <= 2^15 − 2^7: no saturation); packs interleaves 64-bit lanes, the permute restores order */
        const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q_lo, q_hi), 0xD8);
        _mm256_storeu_si256((__m256i *)(act.x + i * SUB), _mm256_shuffle_epi8(words, pair_order));
        act.scale[i] = ldexpf(1.0f, e);  /* 2^e */
        act.sums[i] = act.scale[i] * (float)hsum8_epi32(_mm256_add_epi32(q_lo, q_hi));
    }
    return act;
}

static void release_activations(TileActivations act) {
    free(act.x);
    free(act.scale);
    free(act.sums);
}

/* 32 bytes of a `QUADS` 4-bit tile (chunk j, rows 8·half .. 8·half + 7) -> two `vpmaddubsw` operands: dword c of
 * quads[e] holds the codes of inputs 8j + 4e .. 8j + 4e + 3 of row c. The layout puts them there: a mask and a shift. */
static inline __attribute__((always_inline)) void int4_quads8(const uint8_t *bytes, __m256i quads[2]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)bytes);
    quads[0] = _mm256_and_si256(v, low);
    quads[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

/* The 6-bit codes of chunk j of a `QUADS` Q6_K tile, rows of `half`, arranged as `int4_quads8` arranges 4-bit ones:
 * the nibbles with their top bits (`gguf_matmul._quad_high_bits`: bits 0-1 and 2-3 of a byte for rows 0-7, 4-5 and
 * 6-7 for rows 8-15) moved to bits 4-5 by a shift and a mask. */
static inline __attribute__((always_inline)) void q6_quads8(const uint8_t *tile, int chunk, int half, __m256i quads[2]) {
    const __m256i top = _mm256_set1_epi8(0x30);
    int4_quads8(tile + chunk * 64 + half * 32, quads);
    const __m256i high = _mm256_loadu_si256((const __m256i *)(tile + 256 + chunk * 32));
    const __m256i first = half ? high : _mm256_slli_epi16(high, 4);
    const __m256i second = half ? _mm256_srli_epi16(high, 2) : _mm256_slli_epi16(high, 2);
    quads[0] = _mm256_or_si256(quads[0], _mm256_and_si256(first, top));
    quads[1] = _mm256_or_si256(quads[1], _mm256_and_si256(second, top));
}

/* The 5-bit codes of chunk j of a `QUADS` 5-bit tile, rows of `half`, arranged as `int4_quads8` arranges 4-bit ones: the
 * nibbles with their fifth bits, which byte i of the tile's 32-byte vector j / 2 holds at bit 4·(j % 2) + 2·half + e
 * for byte i of quads[e] (`int4_layout._fifth_bit_quads`), moved to bit 4 by a shift and a mask. A 16-bit shift moves
 * a neighbouring byte's bits into this byte's bits 0-3 or 5-7 only, which the mask drops. */
static inline __attribute__((always_inline)) void int5_quads8(const uint8_t *tile, int chunk, int half, __m256i quads[2]) {
    const __m256i fifth = _mm256_set1_epi8(0x10);
    int4_quads8(tile + chunk * 64 + half * 32, quads);
    const __m256i high = _mm256_loadu_si256((const __m256i *)(tile + 256 + (chunk / 2) * 32));
    for (int e = 0; e < 2; e++) {
        const int bit = 4 * (chunk % 2) + 2 * half + e;
        const __m256i moved = bit < 4 ? _mm256_slli_epi16(high, 4 - bit) : _mm256_srli_epi16(high, bit - 4);
        quads[e] = _mm256_or_si256(quads[e], _mm256_and_si256(moved, fifth));
    }
}

/* The codes of chunk j of a 4-bit tile, or a 5-bit one where `bits` is 5 (a constant after inlining), rows of `half`. */
static inline __attribute__((always_inline)) void affine_quads8(const uint8_t *tile, int chunk, int half, int bits,
                                                               __m256i quads[2]) {
    if (bits == 5)
        int5_quads8(tile, chunk, half, quads);
    else
        int4_quads8(tile + chunk * 64 + half * 32, quads);
}

/* `vpmaddubsw` operands of 8 rows -> four vectors of int16 code pairs: dword lane c of rows[b] = (q[c][8j + b],
 * q[c][8j + 4 + b]), the pairs of the int16 kernels (activations stored to match: `tile_activations`). A 4 x 4 byte
 * transpose per 16-byte lane makes the bytes pair-major (byte 4·b + c % 4), then bytes are interleaved and widened. */
static inline __attribute__((always_inline)) void quads_to_pair_rows8(const __m256i quads[2], __m256i rows[4]) {
    const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                               0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i first = _mm256_shuffle_epi8(quads[0], transpose), second = _mm256_shuffle_epi8(quads[1], transpose);
    const __m256i pairs0 = _mm256_unpacklo_epi8(first, second), pairs1 = _mm256_unpackhi_epi8(first, second);
    rows[0] = _mm256_unpacklo_epi8(pairs0, zero);
    rows[1] = _mm256_unpackhi_epi8(pairs0, zero);
    rows[2] = _mm256_unpacklo_epi8(pairs1, zero);
    rows[3] = _mm256_unpackhi_epi8(pairs1, zero);
}

/* Fetch the lines at `offset` of each 64 bytes of a tile of `bytes`, PREFETCH_BYTES ahead of `tile`. */
static inline __attribute__((always_inline)) void prefetch_tile(const uint8_t *tile, int bytes, int offset) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(tile + PREFETCH_BYTES + line + offset), _MM_HINT_T0);
}

/* sum + Σ of the two int16 products of each dword lane. */
#define DOT(sum, rows, pair) _mm256_add_epi32((sum), _mm256_madd_epi16((rows), (pair)))

/* sum[t] = Σ q·x̂ over inputs 16·part .. 16·part + 15 (chunks 2·part, 2·part + 1) of the rows of `half` of a 4-bit
 * tile (5-bit where `bits` is 5), for `tokens` tokens (constants after inlining) whose x̂ start at `xg`, K apart. */
static inline __attribute__((always_inline)) void affine_part_sums(const uint8_t *tile, int half, int bits,
                                                                  const int16_t *xg, int64_t K, int tokens, int part,
                                                                  __m256i sum[]) {
    for (int t = 0; t < tokens; t++) sum[t] = _mm256_setzero_si256();
    for (int chunk = 2 * part; chunk < 2 * part + 2; chunk++) {
        __m256i quads[2], rows[4];
        affine_quads8(tile, chunk, half, bits, quads);
        quads_to_pair_rows8(quads, rows);
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < tokens; t++) {  /* x̂ in pair order: the dword is (x̂[8·chunk + j], x̂[8·chunk + 4 + j]) */
                const int32_t *xp = (const int32_t *)(xg + t * K + 8 * chunk + 2 * j);
                sum[t] = DOT(sum[t], rows[j], _mm256_set1_epi32(xp[0]));
            }
    }
}

/* `call(T)` with T = tokens as a constant (1..MAX_TOKENS), so the accumulators stay in registers. */
#define WITH_CONSTANT_TOKENS(tokens, call) \
    switch (tokens) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; default: call(4); break; }

/* Half `half` (8 rows) of a block of 16 output rows of 4-bit tiles (5-bit where `bits` is 5) against `tokens` tokens
 * (constants after inlining). */
static inline __attribute__((always_inline)) void affine_half(const uint8_t *codes, const uint16_t *block_scale,
                                                             const uint16_t *block_zero, const TileActivations *act,
                                                             int64_t K, int64_t groups, int tokens, int half, float *y,
                                                             int64_t ldy, int bits) {
    const int tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    __m256 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_codes = codes + g * tile_bytes;
        prefetch_tile(group_codes, tile_bytes, half * 32);
        const __m256 s = bf16x8_to_ps(block_scale + g * 16 + half * 8), z = bf16x8_to_ps(block_zero + g * 16 + half * 8);
        const int16_t *xg = act->x + g * GROUP;
        for (int part = 0; part < 2; part++) {
            __m256i sum[MAX_TOKENS];
            affine_part_sums(group_codes, half, bits, xg, K, tokens, part, sum);
            for (int t = 0; t < tokens; t++) {
                const float scale = act->scale[t * 2 * groups + 2 * g + part];
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(scale)), _mm256_cvtepi32_ps(sum[t]), acc[t]);
            }
        }
        const __m256 offset = _mm256_fmsub_ps(s, _mm256_set1_ps(bits == 5 ? 16.0f : 8.0f), z);
        for (int t = 0; t < tokens; t++) {
            const float *sums = act->sums + t * 2 * groups + 2 * g;
            acc[t] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(sums[0] + sums[1]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm256_storeu_ps(y + t * ldy + half * 8, acc[t]);
}

/* Half `half` (8 rows) of a block of 16 output rows of Q6_K tiles against `tokens` tokens. */
static inline __attribute__((always_inline)) void q6_half(const uint8_t *tiles, const float *d, const TileActivations *act,
                                                         int64_t K, int64_t groups, int tokens, int half, float *y, int64_t ldy) {
    __m256 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tiles + g * Q6_TILE_BYTES;
        prefetch_tile(tile, Q6_TILE_BYTES, 0);
        const __m256 dg = _mm256_loadu_ps(d + (g / 8) * 16 + half * 8);
        for (int sub = 0; sub < 2; sub++) {  /* inputs 16·sub .. 16·sub + 15: chunks 2·sub, 2·sub + 1 */
            __m256i sum[MAX_TOKENS];
            for (int t = 0; t < tokens; t++) sum[t] = _mm256_setzero_si256();
            const int16_t *xs = act->x + g * GROUP + sub * SUB;
            for (int c = 0; c < 2; c++) {
                __m256i quads[2], rows[4];
                q6_quads8(tile, 2 * sub + c, half, quads);
                quads_to_pair_rows8(quads, rows);
                for (int j = 0; j < 4; j++)
                    for (int t = 0; t < tokens; t++) {
                        const int32_t *xp = (const int32_t *)(xs + t * K);
                        sum[t] = DOT(sum[t], rows[j], _mm256_set1_epi32(xp[4 * c + j]));
                    }
            }
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 384 + sub * 16 + half * 8))));
            const __m256 s = _mm256_mul_ps(sc, dg);
            for (int t = 0; t < tokens; t++) {
                const int64_t part = t * 2 * groups + 2 * g + sub;
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(act->scale[part])), _mm256_cvtepi32_ps(sum[t]), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(32.0f)), _mm256_set1_ps(act->sums[part]), acc[t]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) _mm256_storeu_ps(y + t * ldy + half * 8, acc[t]);
}

/* ----- 4- and 5-bit tiles (`int4_layout`) --------------------------------------------------- */
/* x [tokens, K] bf16 -> y [tokens, N] float32 (rows `ldy` apart); 4-bit tiles, or 5-bit where `bits` is 5;
 * tokens <= MAX_TOKENS, K % 32 == 0, N % 16 == 0. */
static void affine_chunk(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x,
                         float *y, int64_t N, int64_t K, int tokens, int64_t ldy, int bits) {
    const int64_t groups = K / GROUP, items = 2 * (N / 16);
    const TileActivations act = tile_activations(x, K, tokens);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t nb = item / 2;
        const int half = (int)(item % 2);
        const uint16_t *bs = scale + nb * groups * 16, *bz = zero + nb * groups * 16;
        float *out = y + nb * 16;
        if (bits == 5) {
            const uint8_t *codes = tiles + nb * groups * INT5_TILE_BYTES;
#define INT5_HALF(T) affine_half(codes, bs, bz, &act, K, groups, T, half, out, ldy, 5)
            WITH_CONSTANT_TOKENS(tokens, INT5_HALF)
#undef INT5_HALF
        } else {
            const uint8_t *codes = tiles + nb * groups * INT4_TILE_BYTES;
#define INT4_HALF(T) affine_half(codes, bs, bz, &act, K, groups, T, half, out, ldy, 4)
            WITH_CONSTANT_TOKENS(tokens, INT4_HALF)
#undef INT4_HALF
        }
    }
    release_activations(act);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T in passes of up to MAX_TOKENS tokens. */
static void affine_passes(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x,
                          float *y, int64_t N, int64_t K, int64_t tokens, int bits) {
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        const int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        affine_chunk(tiles, scale, zero, x + t0 * K, y + t0 * N, N, K, chunk, N, bits);
    }
}

void int4_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                 const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    affine_passes(tiles, scale, zero, x, y, N, K, tokens, 4);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in 5-bit tiles (`int4_layout`, bits 5). */
void int5_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                 const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    affine_passes(tiles, scale, zero, x, y, N, K, tokens, 5);
}

/* ----- Q6_K tiles ----------------------------------------------------------------------------- */
static void q6_chunk(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                     int tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, items = 2 * (N / 16);
    const TileActivations act = tile_activations(x, K, tokens);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t nb = item / 2;
        const int half = (int)(item % 2);
        const uint8_t *block = tiles + nb * groups * Q6_TILE_BYTES;
        const float *bd = d + nb * (K / 256) * 16;
        float *out = y + nb * 16;
#define Q6_HALF(T) q6_half(block, bd, &act, K, groups, T, half, out, ldy)
        WITH_CONSTANT_TOKENS(tokens, Q6_HALF)
#undef Q6_HALF
    }
    release_activations(act);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W as Q6_K tiles; K % 256 == 0, N % 16 == 0. */
void q6k_matmul(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                     int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        const int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        q6_chunk(tiles, d, x + t0 * K, y + t0 * N, N, K, chunk, N);
    }
}
