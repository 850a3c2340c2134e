/* y = x W^T on Intel AMX (bf16 tiles) for weights kept in 4-bit and Q6_K tiles.
 *
 * Why: PyTorch's CPU int4 kernel costs about linearly per token (0.48 ms for one token through an
 * 8960x1536 weight here, 3.3 ms for 16), and so do the AVX-512 kernels past 8 tokens, while a
 * tile multiply costs the same for 1 to 16 tokens. Speculative decoding verifies k + 1 tokens a
 * pass, so a flat cost is what it needs.
 *
 * How: no weight is dequantized to float. Each code q becomes the bf16 number 128 + q by integer
 * ops (`avx512/tile_unpack.h`: bf16 bits 0x4300 | q), laid out as the rows of a B tile (AMX's
 * pair-interleaved layout: row r holds input pair (2r, 2r + 1) of 16 outputs), and one
 * `tdpbf16ps` multiplies it into every token of the pass at once (C = x · (128 + q) in float32).
 * The scales are applied to the tokens x 16 result in float32, with S = Σ x over the group:
 *   4-bit (`int4_layout`, w = s·(q − 8) + z, groups of 32, one tile of 16 pairs):
 *       y += s ⊙ C − (136 s − z) ⊙ S
 *   5-bit (`int4_layout`, bits 5: a 4-bit tile's nibbles, then the codes' fifth bits as byte masks; w = s·(q − 16) + z):
 *       y += s ⊙ C − (144 s − z) ⊙ S
 *   Q6_K (`gguf_matmul.pack_q6k`, w = d·sc·(q − 32), sub-blocks of 16 inputs, one tile of 8 pairs
 *   each, since every sub-block has its own scale):
 *       y += s ⊙ C − 160 s ⊙ S,  s = d·sc
 * which is x · W up to float32 rounding; x is the model's bf16 activations. The next tile is
 * built while the tile unit multiplies; results are stored a step later and scaled a step after that.
 *
 * Each token's result does not depend on the other tokens of the pass: the same tile products
 * and the same float32 order for 1 or 16 tokens, so a verify pass agrees with one-token decoding.
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vectors.h"
#include "tile_unpack.h"
#include "tiles.h"  /* affine_passes */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TOKENS 16  /* tokens a tile multiply takes (A and C tile rows) */
#define GROUP 32
#define SUB 16
#define Q6_TILE_BYTES 416
#ifndef AMX_PREFETCH_BYTES
#define AMX_PREFETCH_BYTES 4096  /* codes are fetched this far ahead, every line of a tile */
#endif

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Ask the kernel for the AMX tile state; 0 on success (then AMX instructions may run). */
int amx_tiles_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

/* Tiles 0 and 4: A, tokens x `inputs` bf16; 1 and 5: B, inputs / 2 pairs x 16 outputs (for even and odd steps);
 * 2, 3, 6 and 7: C, tokens x 16 float32 (in turn). */
static void configure_tiles(int tokens, int inputs) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    for (int a = 0; a <= 4; a += 4) {
        config.rows[a] = (uint8_t)tokens; config.colsb[a] = (uint16_t)(inputs * 2);
        config.rows[a + 1] = (uint8_t)(inputs / 2); config.colsb[a + 1] = 64;
    }
    for (int c = 2; c <= 7; c += (c == 3 ? 3 : 1)) {  /* 2, 3, 6, 7 */
        config.rows[c] = (uint8_t)tokens; config.colsb[c] = 64;
    }
    _tile_loadconfig(&config);
}

/* Four B tile rows (64 bytes each) from four vectors of bf16 pairs. */
static inline __attribute__((always_inline)) void store_rows(uint16_t *b_rows, const __m512i rows[4]) {
    for (int j = 0; j < 4; j++) _mm512_store_si512((void *)(b_rows + j * 32), rows[j]);
}

/* The 4-bit B tile (16 pairs x 16 outputs) of a group, from its 256 bytes. */
static inline __attribute__((always_inline)) void int4_b_tile(const uint8_t *tile, uint16_t *b_tile) {
    for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)(tile + AMX_PREFETCH_BYTES + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; chunk++) {
        __m512i rows[4];
        unpack_pairs(tile + chunk * 64, BF16_CODES, rows);
        store_rows(b_tile + chunk * 4 * 32, rows);
    }
}

/* The 5-bit B tile (16 pairs x 16 outputs) of a group, from its 320 bytes (`five_unpack_pairs`). */
static inline __attribute__((always_inline)) void int5_b_tile(const uint8_t *tile, uint16_t *b_tile) {
    for (int line = 0; line < INT5_TILE_BYTES; line += 64) _mm_prefetch((const char *)(tile + AMX_PREFETCH_BYTES + line), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; chunk++) {
        __m512i rows[4];
        five_unpack_pairs(tile, chunk, BF16_CODES, rows);
        store_rows(b_tile + chunk * 4 * 32, rows);
    }
}

/* The Q6_K B tile (8 pairs x 16 outputs) of sub-block `sub` (0, 1) of a tile. */
static inline __attribute__((always_inline)) void q6_b_tile(const uint8_t *tile, int sub, uint16_t *b_tile) {
    if (sub == 0)
        for (int line = 0; line < Q6_TILE_BYTES; line += 64) _mm_prefetch((const char *)(tile + AMX_PREFETCH_BYTES + line), _MM_HINT_T0);
    for (int half = 0; half < 2; half++) {
        __m512i rows[4];
        q6_unpack_pairs(tile, 2 * sub + half, BF16_CODES, rows);
        store_rows(b_tile + half * 4 * 32, rows);
    }
}

/* acc[t] += s ⊙ C[t] − offset · S[t]: one multiply's float32 products, scaled (16 outputs). */
static inline __attribute__((always_inline)) void scale_into(const float *c_tile, __m512 s, __m512 offset, const float *sums,
                                                            int64_t stride, int tokens, __m512 *acc) {
    for (int t = 0; t < tokens; t++) {
        acc[t] = _mm512_fmadd_ps(s, _mm512_load_ps(c_tile + t * 16), acc[t]);
        acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[t * stride]), acc[t]);
    }
}

/* sums[t · parts + p] = Σ of token t's inputs p·width .. p·width + width − 1 (width 16 or 32). */
static void input_sums(const uint16_t *x, int64_t K, int tokens, int width, float *sums) {
    const int64_t parts = K / width;
    for (int t = 0; t < tokens; t++)
        for (int64_t p = 0; p < parts; p++) {
            __m512 v = bf16x16_to_ps(x + t * K + p * width);
            if (width == 32) v = _mm512_add_ps(v, bf16x16_to_ps(x + t * K + p * width + 16));
            sums[t * parts + p] = _mm512_reduce_add_ps(v);
        }
}

#define B_AHEAD 2  /* B tiles are built this many steps before their multiply: a tile load of bytes still in the
                    * store buffer waits for them to reach the cache (built one step ahead, the multiplies stalled) */
#define B_RING 4   /* B tile buffers: B_AHEAD + 1 rounded up to a power of two */

/* One multiply step of a block, its tile registers constants (unrolled: A and B 0 and 1 on even steps, 4 and 5
 * on odd ones; C 2, 3, 6, 7 in turn): build a later B tile, multiply this one into C, then store the previous
 * step's C (its multiply has had this step's work to finish in) and scale the one before it (stored a step
 * ago). Storing a C right after its own multiply stalled on the multiply's latency every step, and so did
 * zeroing a C register stored only a step before (two C registers; now four). */
#define AMX_STEP(I, A_TILE, B_TILE, C_TILE, PREVIOUS_C_TILE, WIDTH)                          \
    if ((I) + B_AHEAD < steps) BUILD((I) + B_AHEAD, b_tiles[((I) + B_AHEAD) % B_RING]);      \
    _tile_loadd(B_TILE, b_tiles[(I) % B_RING], 64);                                         \
    _tile_loadd(A_TILE, x + (I) * (WIDTH), K * 2);                                          \
    _tile_zero(C_TILE);                                                                     \
    _tile_dpbf16ps(C_TILE, A_TILE, B_TILE);                                                 \
    if ((I) > 0) _tile_stored(PREVIOUS_C_TILE, c_tiles[((I) - 1) & 1], 64);                 \
    if ((I) > 1) SCALE((I) - 2);

/* Every step of a block (steps even), with the kernel's BUILD(step, buffer) and SCALE(step); WIDTH inputs a step. */
#define AMX_ALL_STEPS(WIDTH)                                                                \
    for (int64_t step = 0; step < B_AHEAD; step++) BUILD(step, b_tiles[step]);              \
    int64_t step = 0;                                                                       \
    for (; step + 4 <= steps; step += 4) {                                                  \
        AMX_STEP(step, 0, 1, 2, 7, WIDTH)                                                   \
        AMX_STEP(step + 1, 4, 5, 3, 2, WIDTH)                                               \
        AMX_STEP(step + 2, 0, 1, 6, 3, WIDTH)                                               \
        AMX_STEP(step + 3, 4, 5, 7, 6, WIDTH)                                               \
    }                                                                                       \
    if (step < steps) { /* two steps left */                                                \
        AMX_STEP(step, 0, 1, 2, 7, WIDTH)                                                   \
        AMX_STEP(step + 1, 4, 5, 3, 2, WIDTH)                                               \
        _tile_stored(3, c_tiles[(steps - 1) & 1], 64);                                      \
    } else {                                                                                \
        _tile_stored(7, c_tiles[(steps - 1) & 1], 64);                                      \
    }                                                                                       \
    SCALE(steps - 2)                                                                        \
    SCALE(steps - 1)

/* x [tokens, K] bf16 -> y [tokens, N] float32 (rows `ldy` apart); 4-bit tiles, or 5-bit where `bits` is 5;
 * tokens <= AMX_TOKENS, K % 64 == 0. */
static void affine_amx_chunk(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                             const uint16_t *x, float *y, int64_t N, int64_t K, int tokens, int64_t ldy, int bits) {
    const int64_t steps = K / GROUP, blocks = N / 16;
    const int64_t tile_bytes = bits == 5 ? INT5_TILE_BYTES : 256;
    const float offset = bits == 5 ? 144.0f : 136.0f;  /* 128 + the codes' middle */
    float sums[AMX_TOKENS * steps];  /* S_g of token t at [t · steps + g] */
    input_sums(x, K, tokens, GROUP, sums);
#pragma omp parallel
    {
        configure_tiles(tokens, GROUP);
        __attribute__((aligned(64))) uint16_t b_tiles[B_RING][16 * 32];  /* B is built B_AHEAD groups ahead */
        __attribute__((aligned(64))) float c_tiles[2][AMX_TOKENS * 16];  /* C is stored a step behind, scaled two behind */
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            __m512 acc[AMX_TOKENS];
            for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
            const uint8_t *codes = tiles + nb * steps * tile_bytes;
            const uint16_t *block_scale = scale + nb * steps * 16, *block_zero = zero + nb * steps * 16;
#define BUILD(G, B_TILE)                                                                                          \
    {                                                                                                             \
        if (bits == 5) int5_b_tile(codes + (G) * INT5_TILE_BYTES, B_TILE);                                       \
        else int4_b_tile(codes + (G) * 256, B_TILE);                                                              \
        _mm_prefetch((const char *)(block_scale + (G) * 16 + AMX_PREFETCH_BYTES / 8), _MM_HINT_T0);               \
        _mm_prefetch((const char *)(block_zero + (G) * 16 + AMX_PREFETCH_BYTES / 8), _MM_HINT_T0);                \
    }
#define SCALE(G)                                                                                                  \
    {                                                                                                             \
        const __m512 s = bf16x16_to_ps(block_scale + (G) * 16), z = bf16x16_to_ps(block_zero + (G) * 16);        \
        scale_into(c_tiles[(G) & 1], s, _mm512_fmsub_ps(s, _mm512_set1_ps(offset), z), sums + (G), steps, tokens, acc); \
    }
            AMX_ALL_STEPS(GROUP)  /* steps is even (K % 64) */
#undef BUILD
#undef SCALE
            for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy + nb * 16, acc[t]);
        }
        _tile_release();
    }
}

/* x [tokens, K] bf16 -> y [tokens, N] float32 (rows `ldy` apart); Q6_K tiles; tokens <= AMX_TOKENS, K % 256 == 0. */
static void q6k_amx_chunk(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                          int tokens, int64_t ldy) {
    const int64_t steps = K / SUB, blocks = N / 16;  /* a step: one sub-block of 16 inputs */
    float sums[AMX_TOKENS * steps];  /* S of token t, sub-block b at [t · steps + b] */
    input_sums(x, K, tokens, SUB, sums);
#pragma omp parallel
    {
        configure_tiles(tokens, SUB);
        __attribute__((aligned(64))) uint16_t b_tiles[B_RING][8 * 32];
        __attribute__((aligned(64))) float c_tiles[2][AMX_TOKENS * 16];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            __m512 acc[AMX_TOKENS];
            for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
            const uint8_t *block = tiles + nb * (K / GROUP) * Q6_TILE_BYTES;
            const float *block_d = d + nb * (K / 256) * 16;
#define BUILD(B, B_TILE) q6_b_tile(block + ((B) / 2) * Q6_TILE_BYTES, (int)((B) % 2), B_TILE)
#define SCALE(B)                                                                                                  \
    {                                                                                                             \
        const __m512 s = q6_scales(block + ((B) / 2) * Q6_TILE_BYTES, block_d + ((B) / 16) * 16, (int)((B) % 2)); \
        scale_into(c_tiles[(B) & 1], s, _mm512_mul_ps(s, _mm512_set1_ps(160.0f)), sums + (B), steps, tokens, acc); \
    }
            AMX_ALL_STEPS(SUB)
#undef BUILD
#undef SCALE
            for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy + nb * 16, acc[t]);
        }
        _tile_release();
    }
}
#undef AMX_STEP
#undef AMX_ALL_STEPS

void int4_amx_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                     const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    affine_passes(affine_amx_chunk, AMX_TOKENS, tiles, scale, zero, x, y, N, K, tokens, 4);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W as 5-bit tiles (`int4_layout.pack_rows`, bits 5). */
void int5_amx_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                     const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    affine_passes(affine_amx_chunk, AMX_TOKENS, tiles, scale, zero, x, y, N, K, tokens, 5);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W as Q6_K tiles; K % 256 == 0, N % 16 == 0. */
void q6k_amx_matmul(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                    int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += AMX_TOKENS) {
        int chunk = (int)(tokens - t0 < AMX_TOKENS ? tokens - t0 : AMX_TOKENS);
        q6k_amx_chunk(tiles, d, x + t0 * K, y + t0 * N, N, K, chunk, N);
    }
}
