/* AVX-512 kernels for weights kept in 4-bit and 6-bit tiles: y = x W^T without unpacking W to float,
 * for CPUs without AMX (AMD Zen 4/5, Intel Xeons where AMX is absent or not granted).
 *
 * Why: PyTorch's CPU int4 kernel works on 4 tokens at a time and unpacks every weight again for
 * each 4 (measured on a 2-core AMD EPYC, 28 layers of a 1.5B model: one token 17 ms, 4 tokens
 * 25 ms, 5 tokens 50 ms), while a verify pass carries k + 1 tokens.
 *
 * How: a tile holds 16 output rows x 32 inputs. Its codes become 16-bit numbers by integer ops
 * alone, as vectors that each hold one input pair (2r, 2r + 1) of the 16 rows: what a dot-product
 * instruction multiplies with a broadcast pair of activations (`avx512/tile_unpack.h`; `avx512/amx_tiles.h` shares
 * the 4-bit layout, see `int4_layout.py`). A tile is unpacked once per pass of up to MAX_TOKENS
 * tokens and then costs one dot-product instruction per 32 weights per token.
 *
 * Two flavours of dot product, one per build (`avx512_tiles.dots()` picks the faster for the CPU):
 *
 * int16 (the default build; `vpdpwssd`, AVX-512 VNNI): codes as int16 q. Each token's 16 inputs at a
 * time are written as x = 2^e · x̂ with x̂ int16 and 2^e the power of two that puts their max|x| in
 * [2^14, 2^15): every input within a factor 2^7 of the largest of its 16 is exact (a bf16 number has
 * 8 significant bits), smaller ones are rounded to a multiple of 2^e (by at most 2^-15 of the
 * largest). The sums Σ q·x̂ are then exact integers (a 4-bit half-group's below 2^24, so exact in
 * float32 too; a Q6_K sub-block's rounded once to float32), where bf16 dot products round every
 * partial sum. Steps per 16 rather than per 32 keep a token's few huge activations (the attention
 * sink's) from coarsening as many neighbours: on the 1.5B target, logits stay as close to a float32
 * reference as with the bf16 flavour (tests/test_real_kernels.py). The scales are applied in float32
 * with S = Σ x (exact):
 *   4-bit (w = s·(q − 8) + z, groups of 32):  y += (s·2^e₀) ⊙ Σ₀ q·x̂ + (s·2^e₁) ⊙ Σ₁ q·x̂ − (8 s − z) ⊙ S
 *     (Σ₀, Σ₁: the group's inputs 0-15 and 16-31)
 *   Q6_K  (w = d·sc·(q − 32), sub-blocks of 16): y += (s·2^e) ⊙ Σ q·x̂ − 32 s ⊙ S,  s = d·sc
 * (s·2^e is exact). It needs no BF16 instruction, so VNNI-only CPUs (Cascade Lake, Ice Lake) run it.
 *
 * bf16 (built with -DTILE_DOTS_BF16; `vdpbf16ps`, AVX-512 BF16): codes as the bf16 number 128 + q
 * (exact), x as it is, float32 sums; then
 *   4-bit:  y += s ⊙ Σ (128 + q)·x − (136 s − z) ⊙ S      Q6_K:  y += s ⊙ Σ (128 + q)·x − 160 s ⊙ S
 * Its per-group float work is 3 vector ops a token against 7 (4-bit) and 5 (Q6_K) for int16, which
 * decides where the two dot products issue at a similar rate. Measured, 8960x1536 4-bit, 8 tokens:
 *   - a 2-core Intel Xeon without AMX: `vpdpwssd` 62 G multiply-adds/s a core, `vdpbf16ps` 43;
 *     int16 0.66 ms, bf16 1.52 ms;
 *   - a 2-core AMD EPYC (Zen 4): 38.6 and 34.8 (one instruction each 0.83 and 0.92 ns);
 *     int16 0.65 ms, bf16 0.54 ms.
 *
 * Each token is computed alone, in the same order whatever the pass width (two accumulator chains
 * per group or sub-block, added at its end), so a verify pass agrees bit for bit with one-token decoding. A
 * prefill runs in passes of MAX_TOKENS too: at 8 tokens a pass the unpacking is paid once per 8
 * and the dot products run near the cores' peak, so unpacking the weight to bf16 for one dense
 * GEMM was slower at every prompt length measured (a 1.5B target, 2 cores: 50 tokens 0.53 s
 * dense vs 0.23 s here, 700 tokens 3.45 vs 3.27 s). Codes
 * are prefetched several tiles ahead (all their lines: 2x faster at 8 tokens when streaming from
 * memory). Rows are split across OpenMP threads (PyTorch's libgomp when torch is loaded first).
 *
 * Q6_K tiles (`gguf_matmul.pack_q6k`, 416 bytes, 6.5 bits a weight like the file):
 *   - 256 bytes: the low nibbles of the codes in the 4-bit layout;
 *   - 128 bytes: for each 64 of those, 32 bytes whose four 2-bit fields give the high bits of the
 *     bytes that the nibble unpacking makes (fields 0/1: first/second half of the first pair
 *     vector, 2/3: of the second), so that two variable shifts and a mask put them in place;
 *   - 32 bytes: sc of sub-block 0 (inputs 0-15) of the 16 rows, then of sub-block 1;
 * and d as float32 [N/16][K/256][16].
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <stdlib.h>

#include "vectors.h"
#include "tile_unpack.h"

#define GROUP 32
#define SUB 16
#define MAX_TOKENS 8
#define INT4_TILE_BYTES 256
#define Q6_TILE_BYTES 416
/* Codes are fetched this far ahead, every line of a tile: PREFETCH_BYTES in passes of at most PREFETCH_FAR_TOKENS
 * tokens, PREFETCH_NEAR_BYTES in wider ones (`avx512/int8_tiles.h`). A Zen 5, 2 threads, the bundled target after a
 * 300-token cache, builds in alternating processes: 8 KB rather than 4 made 2- and 3-token passes 3-15% faster
 * (one token the same), and a 128-token prompt read 15% slower (452 against 389-395 ms). */
#define PREFETCH_BYTES 8192
#define PREFETCH_NEAR_BYTES 4096
#define PREFETCH_FAR_TOKENS 8

/* Fetch every line of the tile `ahead` bytes ahead of `tile`. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *tile, int tile_bytes, int ahead) {
    for (int line = 0; line < tile_bytes; line += 64)
        _mm_prefetch((const char *)(tile + ahead + line), _MM_HINT_T0);
}

/* `call(T)` with T = tokens as a constant (1..MAX_TOKENS), so the accumulators stay in registers. */
#define WITH_CONSTANT_TOKENS(tokens, call)                                                     \
    switch (tokens) {                                                                          \
        case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;                \
        case 4: call(4); break; case 5: call(5); break; case 6: call(6); break;                \
        case 7: call(7); break; default: call(8); break;                                       \
    }

/* Four vectors of 16-bit code pairs (high byte `high`), pairs 4·chunk .. 4·chunk + 3 of a 4-bit tile, or of a 5-bit
 * one where `bits` is 5. */
static inline __attribute__((always_inline)) void unpack_tile_chunk(const uint8_t *tile, int chunk, int bits, int high,
                                                                   __m512i rows[4]) {
    if (bits == 5)
        five_unpack_pairs(tile, chunk, high, rows);
    else
        unpack_pairs(tile + chunk * 64, high, rows);
}

/* ----- the two dot flavours: activations, one dot-product step, 4-bit blocks, Q6_K scales -------------- */
#ifndef TILE_DOTS_BF16
/* int16 (`vpdpwssd`): codes as int16 q; sums of a half-group or sub-block exact in int32. */
#define TILE_CODES INT16_CODES
typedef int16_t TileInput;
typedef __m512i DotSum;
#define DOT_ZERO() _mm512_setzero_si512()
#define DOT(sum, rows, pair) _mm512_dpwssd_epi32((sum), (rows), (pair))

/* Token activations as int16 with a power of two per 16 inputs (module doc): x [tokens, K] bf16 -> x̂ [tokens, K],
 * 2^e and S = Σ x (exact), both per 16 inputs [tokens, K/16]. */
typedef struct {
    int16_t *x;
    float *scale, *sums;
} TileActivations;

static TileActivations tile_activations(const uint16_t *x, int64_t K, int tokens) {
    const int64_t parts = K / SUB;
    TileActivations act = {malloc(sizeof(int16_t) * (size_t)(tokens * K)), malloc(sizeof(float) * (size_t)(tokens * parts)),
                           malloc(sizeof(float) * (size_t)(tokens * parts))};
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t i = 0; i < tokens * parts; i++) {
        const __m512 v = bf16x16_to_ps(x + i * SUB);
        const float amax = _mm512_reduce_max_ps(_mm512_andnot_ps(sign, v));
        /* e = floor(log2 max|x|) − 14, so that max|x| / 2^e lies in [2^14, 2^15) */
        const float e = amax > 0.0f ? _mm_cvtss_f32(_mm_getexp_ss(_mm_set_ss(amax), _mm_set_ss(amax))) - 14.0f : 0.0f;
        const __m512i q = _mm512_cvtps_epi32(_mm512_scalef_ps(v, _mm512_set1_ps(-e)));  /* nearest, ties even */
        _mm256_storeu_si256((__m256i *)(act.x + i * SUB), _mm512_cvtepi32_epi16(q));
        act.scale[i] = _mm_cvtss_f32(_mm_scalef_ss(_mm_set_ss(1.0f), _mm_set_ss(e)));  /* 2^e */
        act.sums[i] = act.scale[i] * (float)_mm512_reduce_add_epi32(q);
    }
    return act;
}

static void release_activations(TileActivations act) {
    free(act.x);
    free(act.scale);
    free(act.sums);
}

/* One block of 16 output rows of 4-bit tiles (or 5-bit where `bits` is 5) against `tokens` tokens (both constants after
 * inlining): w = s·(q − 8) + z (5-bit: s·(q − 16) + z), the group's inputs 0-15 and 16-31 in two chains (each has its own
 * power of two; a 5-bit half-group's sum stays below 16·31·2^15 < 2^24, exact in float32 too). */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *codes, const uint16_t *block_scale,
                                                            const uint16_t *block_zero, const TileActivations *act,
                                                            int64_t K, int64_t groups, int tokens, float *y, int64_t ldy,
                                                            int bits) {
    const int tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_codes = codes + g * tile_bytes;
        prefetch_ahead(group_codes, tile_bytes, PREFETCH_BYTES);
        DotSum first[MAX_TOKENS], second[MAX_TOKENS];  /* inputs 0-15 (chunks 0, 1) and 16-31 (chunks 2, 3) */
        for (int t = 0; t < tokens; t++) first[t] = second[t] = DOT_ZERO();
        const TileInput *xg = act->x + g * GROUP;
        for (int chunk = 0; chunk < 2; chunk++) {
            __m512i rows_a[4], rows_b[4];
            unpack_tile_chunk(group_codes, chunk, bits, TILE_CODES, rows_a);
            unpack_tile_chunk(group_codes, chunk + 2, bits, TILE_CODES, rows_b);
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < tokens; t++) {
                    const int32_t *xp = (const int32_t *)(xg + t * K + 8 * chunk + 2 * j);
                    first[t] = DOT(first[t], rows_a[j], _mm512_set1_epi32(xp[0]));
                    second[t] = DOT(second[t], rows_b[j], _mm512_set1_epi32(xp[8]));
                }
        }
        const __m512 s = bf16x16_to_ps(block_scale + g * 16), z = bf16x16_to_ps(block_zero + g * 16);
        const __m512 offset = _mm512_fmsub_ps(s, _mm512_set1_ps(bits == 5 ? 16.0f : 8.0f), z);
        for (int t = 0; t < tokens; t++) {
            const float *scale = act->scale + t * 2 * groups + 2 * g, *sums = act->sums + t * 2 * groups + 2 * g;
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(scale[0])), _mm512_cvtepi32_ps(first[t]), acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(scale[1])), _mm512_cvtepi32_ps(second[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[0] + sums[1]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* A Q6_K sub-block's two chains of one token into acc: w = s·(q − 32). */
static inline __attribute__((always_inline)) __m512 q6_sub_apply(__m512 acc, DotSum first, DotSum second, __m512 s,
                                                                 const TileActivations *act, int64_t part) {
    const __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(act->scale[part]));
    acc = _mm512_fmadd_ps(sx, _mm512_cvtepi32_ps(_mm512_add_epi32(first, second)), acc);
    return _mm512_fnmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(32.0f)), _mm512_set1_ps(act->sums[part]), acc);
}

#else
/* bf16 (`vdpbf16ps`): codes as the bf16 number 128 + q (exact), x as it is, float32 sums. */
#define TILE_CODES BF16_CODES
typedef uint16_t TileInput;
typedef __m512 DotSum;
#define DOT_ZERO() _mm512_setzero_ps()
#define DOT(sum, rows, pair) _mm512_dpbf16_ps((sum), (__m512bh)(rows), (__m512bh)(pair))

/* Token activations as they are (bf16) and S = Σ x per 16 inputs [tokens, K/16] in float32. */
typedef struct {
    const uint16_t *x;
    float *sums;
} TileActivations;

static TileActivations tile_activations(const uint16_t *x, int64_t K, int tokens) {
    const int64_t parts = K / SUB;
    TileActivations act = {x, malloc(sizeof(float) * (size_t)(tokens * parts))};
    for (int64_t i = 0; i < tokens * parts; i++) act.sums[i] = _mm512_reduce_add_ps(bf16x16_to_ps(x + i * SUB));
    return act;
}

static void release_activations(TileActivations act) { free(act.sums); }

/* One block of 16 output rows of 4-bit tiles (or 5-bit where `bits` is 5) against `tokens` tokens (both constants after
 * inlining): w = s·(128 + q) − (136 s − z) (5-bit: 144 s − z), in two chains (pair vectors 0, 2 and 1, 3 of each chunk;
 * one chunk's codes unpacked at a time: at 4 tokens 0.287 ms where the int16 flavour's loop order took 0.31, 8960x1536
 * on Zen 4). */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *codes, const uint16_t *block_scale,
                                                            const uint16_t *block_zero, const TileActivations *act,
                                                            int64_t K, int64_t groups, int tokens, float *y, int64_t ldy,
                                                            int bits) {
    const int tile_bytes = bits == 5 ? INT5_TILE_BYTES : INT4_TILE_BYTES;
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_codes = codes + g * tile_bytes;
        prefetch_ahead(group_codes, tile_bytes, PREFETCH_BYTES);
        DotSum even[MAX_TOKENS], odd[MAX_TOKENS];
        for (int t = 0; t < tokens; t++) even[t] = odd[t] = DOT_ZERO();
        const TileInput *xg = act->x + g * GROUP;
        for (int chunk = 0; chunk < 4; chunk++) {
            __m512i rows[4];
            unpack_tile_chunk(group_codes, chunk, bits, TILE_CODES, rows);
            for (int j = 0; j < 4; j += 2)
                for (int t = 0; t < tokens; t++) {
                    const int32_t *xp = (const int32_t *)(xg + t * K + 2 * (4 * chunk + j));
                    even[t] = DOT(even[t], rows[j], _mm512_set1_epi32(xp[0]));
                    odd[t] = DOT(odd[t], rows[j + 1], _mm512_set1_epi32(xp[1]));
                }
        }
        const __m512 s = bf16x16_to_ps(block_scale + g * 16), z = bf16x16_to_ps(block_zero + g * 16);
        const __m512 offset = _mm512_fmsub_ps(s, _mm512_set1_ps(bits == 5 ? 144.0f : 136.0f), z);
        for (int t = 0; t < tokens; t++) {
            const float *sums = act->sums + t * 2 * groups + 2 * g;
            acc[t] = _mm512_fmadd_ps(s, _mm512_add_ps(even[t], odd[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[0] + sums[1]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* A Q6_K sub-block's two chains of one token into acc: w = s·(128 + q) − 160 s. */
static inline __attribute__((always_inline)) __m512 q6_sub_apply(__m512 acc, DotSum first, DotSum second, __m512 s,
                                                                 const TileActivations *act, int64_t part) {
    acc = _mm512_fmadd_ps(s, _mm512_add_ps(first, second), acc);
    return _mm512_fnmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(160.0f)), _mm512_set1_ps(act->sums[part]), acc);
}
#endif

/* One block of 16 output rows of Q6_K tiles against `tokens` tokens (a constant after inlining). */
static inline __attribute__((always_inline)) void q6_block(const uint8_t *tiles, const float *d, const TileActivations *act,
                                                          int64_t K, int64_t groups, int tokens, float *y, int64_t ldy) {
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tiles + g * Q6_TILE_BYTES;
        prefetch_ahead(tile, Q6_TILE_BYTES, PREFETCH_BYTES);
        const float *dg = d + (g / 8) * 16;
        for (int sub = 0; sub < 2; sub++) {  /* inputs 16·sub .. 16·sub + 15: chunks 2·sub, 2·sub + 1 */
            DotSum first[MAX_TOKENS], second[MAX_TOKENS];  /* two chains: chunk 2·sub, chunk 2·sub + 1 */
            for (int t = 0; t < tokens; t++) first[t] = second[t] = DOT_ZERO();
            __m512i rows_a[4], rows_b[4];
            q6_unpack_pairs(tile, 2 * sub, TILE_CODES, rows_a);
            q6_unpack_pairs(tile, 2 * sub + 1, TILE_CODES, rows_b);
            const TileInput *xs = act->x + g * GROUP + sub * SUB;
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < tokens; t++) {
                    const int32_t *xp = (const int32_t *)(xs + t * K);
                    first[t] = DOT(first[t], rows_a[j], _mm512_set1_epi32(xp[j]));
                    second[t] = DOT(second[t], rows_b[j], _mm512_set1_epi32(xp[4 + j]));
                }
            const __m512 s = q6_scales(tile, dg, sub);
            for (int t = 0; t < tokens; t++) acc[t] = q6_sub_apply(acc[t], first[t], second[t], s, act, t * 2 * groups + 2 * g + sub);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* ----- 4- and 5-bit tiles (`int4_layout`) --------------------------------------------------- */
/* x [tokens, K] bf16 -> y [tokens, N] float32 (rows `ldy` apart); 4-bit tiles, or 5-bit where `bits` is 5;
 * tokens <= MAX_TOKENS, K % 32 == 0, N % 16 == 0. */
static void affine_chunk(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x,
                         float *y, int64_t N, int64_t K, int tokens, int64_t ldy, int bits) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    const TileActivations act = tile_activations(x, K, tokens);
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        const uint16_t *bs = scale + nb * groups * 16, *bz = zero + nb * groups * 16;
        float *out = y + nb * 16;
        if (bits == 5) {
            const uint8_t *codes = tiles + nb * groups * INT5_TILE_BYTES;
#define INT5_BLOCK(T) block_rows(codes, bs, bz, &act, K, groups, T, out, ldy, 5)
            WITH_CONSTANT_TOKENS(tokens, INT5_BLOCK)
#undef INT5_BLOCK
        } else {
            const uint8_t *codes = tiles + nb * groups * INT4_TILE_BYTES;
#define INT4_BLOCK(T) block_rows(codes, bs, bz, &act, K, groups, T, out, ldy, 4)
            WITH_CONSTANT_TOKENS(tokens, INT4_BLOCK)
#undef INT4_BLOCK
        }
    }
    release_activations(act);
}

/* One pass of a 4- or 5-bit kernel (`affine_chunk`, `affine_amx_chunk`): `tokens` rows of x, y rows `ldy` apart. */
typedef void (*AffineChunk)(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x,
                            float *y, int64_t N, int64_t K, int tokens, int64_t ldy, int bits);

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T in passes of up to `width` tokens of `chunk`. */
static void affine_passes(AffineChunk chunk, int width, const uint8_t *tiles, const uint16_t *scale,
                          const uint16_t *zero, const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens,
                          int bits) {
    for (int64_t t0 = 0; t0 < tokens; t0 += width) {
        const int count = (int)(tokens - t0 < width ? tokens - t0 : width);
        chunk(tiles, scale, zero, x + t0 * K, y + t0 * N, N, K, count, N, bits);
    }
}

void int4_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                 const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    affine_passes(affine_chunk, MAX_TOKENS, tiles, scale, zero, x, y, N, K, tokens, 4);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in 5-bit tiles (`int4_layout`, bits 5). */
void int5_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                 const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    affine_passes(affine_chunk, MAX_TOKENS, tiles, scale, zero, x, y, N, K, tokens, 5);
}

/* ----- Q6_K tiles ----------------------------------------------------------------------------- */
static void q6_chunk(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                     int tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    const TileActivations act = tile_activations(x, K, tokens);
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        const uint8_t *block = tiles + nb * groups * Q6_TILE_BYTES;
        const float *bd = d + nb * (K / 256) * 16;
        float *out = y + nb * 16;
#define Q6_BLOCK(T) q6_block(block, bd, &act, K, groups, T, out, ldy)
        WITH_CONSTANT_TOKENS(tokens, Q6_BLOCK)
#undef Q6_BLOCK
    }
    release_activations(act);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W as Q6_K tiles; K % 256 == 0, N % 16 == 0. */
void q6k_matmul(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        q6_chunk(tiles, d, x + t0 * K, y + t0 * N, N, K, chunk, N);
    }
}
