/* y = x W^T for 4-bit weights in groups of 32 (w = s·q − m, q in 0..15) on Intel AMX (bf16 tiles).
 *
 * Why: PyTorch's CPU int4 kernel costs about linearly per token (0.48 ms for one token through an
 * 8960x1536 weight here, 3.3 ms for 16), while a dense bf16 GEMM on AMX costs the same for 1 to 16
 * tokens. Speculative decoding verifies k + 1 tokens a pass, so a flat cost is what it needs.
 *
 * How: no weight is dequantized to float. Each code q becomes the bf16 number 128 + q by an
 * integer OR (bf16 bits 0x4300 | q: exponent 2^7, mantissa q), so a tile of 16 output rows x 32
 * inputs is built with a few integer ops, and one `tdpbf16ps` multiplies it into every token of
 * the pass at once (C_g = x_g · (128 + q_g) in float32). The group's scale and zero are applied
 * to the 16 x tokens result in float32. With the group's offset stored as z = 8s − m (small for
 * weights centred on zero, so its bf16 rounding costs little, as in PyTorch's int4 layout):
 *     y += s_g · C_g − (136 · s_g − z_g) · S_g,    S_g = Σ_{k in g} x_k (per token)
 * which is x · (s·q − m) up to float32 rounding; x is the model's bf16 activations.
 *
 * Layout (`int4_amx.pack` makes it from codes): for each block of 16 output rows and group g of 32
 * inputs, 256 bytes. The code pair (q[n0 + c][k0 + 2r], q[n0 + c][k0 + 2r + 1]) of tile row r
 * (AMX's pair-interleaved B layout) is one byte, low nibble first, at offset
 * 64·(r / 4) + 16·(c / 4) + 4·(r % 4) + c % 4: the order in which two rounds of byte unpacking
 * (within 128-bit lanes) put four tile rows of 16 pairs, each pair followed by the exponent
 * byte 0x43, into four 64-byte rows of bf16.
 * Scales s and offsets z = 8s − m: bf16 [N/16][K/32][16].
 *
 * Each token's result does not depend on the other tokens of the pass: the same tile products
 * and the same float32 order for 1 or 16 tokens, so a verify pass agrees with one-token decoding.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_vectors.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TOKENS 16  /* tokens a tile multiply takes (A and C tile rows) */
#define GROUP 32

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Ask the kernel for the AMX tile state; 0 on success (then AMX instructions may run). */
int int4_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

static void configure_tiles(int tokens) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    config.rows[0] = (uint8_t)tokens; config.colsb[0] = 64;  /* A: tokens x 32 bf16 inputs */
    config.rows[1] = 16; config.colsb[1] = 64;                /* B: 16 input pairs x 16 outputs x 2 */
    config.rows[2] = (uint8_t)tokens; config.colsb[2] = 64;  /* C, even groups: tokens x 16 float32 */
    config.rows[3] = (uint8_t)tokens; config.colsb[3] = 64;  /* C, odd groups */
    _tile_loadconfig(&config);
}

/* One B tile (16 input pairs x 16 outputs, bf16 128 + q) from its 256 bytes of codes. */
static inline __attribute__((always_inline)) void build_b_tile(const uint8_t *tile, uint16_t *b_tile) {
    const __m512i low = _mm512_set1_epi8(0x0F), exponent = _mm512_set1_epi8(0x43);
    _mm_prefetch((const char *)(tile + 1024), _MM_HINT_T0);
    for (int chunk = 0; chunk < 4; chunk++) {  /* 64 bytes -> tile rows 4·chunk .. 4·chunk + 3 */
        __m512i v = _mm512_loadu_si512((const void *)(tile + chunk * 64));
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        __m512i pairs_a = _mm512_unpacklo_epi8(lo, hi), pairs_b = _mm512_unpackhi_epi8(lo, hi);
        uint16_t *rows = b_tile + chunk * 4 * 32;
        _mm512_store_si512((void *)(rows), _mm512_unpacklo_epi8(pairs_a, exponent));
        _mm512_store_si512((void *)(rows + 32), _mm512_unpackhi_epi8(pairs_a, exponent));
        _mm512_store_si512((void *)(rows + 64), _mm512_unpacklo_epi8(pairs_b, exponent));
        _mm512_store_si512((void *)(rows + 96), _mm512_unpackhi_epi8(pairs_b, exponent));
    }
}

/* acc[t] += s ⊙ C[t] − (136 s − z) · S_g[t]: group g's float32 products, scaled (16 outputs). */
static inline __attribute__((always_inline)) void scale_group(const float *c_tile, const uint16_t *block_scale,
                                                             const uint16_t *block_zero, const float *sums,
                                                             int64_t groups, int64_t g, int tokens, __m512 *acc) {
    const __m512 s = bf16x16_to_ps(block_scale + g * 16), z = bf16x16_to_ps(block_zero + g * 16);
    const __m512 offset = _mm512_fmsub_ps(s, _mm512_set1_ps(136.0f), z);
    for (int t = 0; t < tokens; t++) {
        acc[t] = _mm512_fmadd_ps(s, _mm512_load_ps(c_tile + t * 16), acc[t]);
        acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[t * groups + g]), acc[t]);
    }
}

/* x [tokens, K] bf16 -> y [tokens, N] float32 (rows `ldy` apart); tokens <= AMX_TOKENS, K % 64 == 0. */
static void int4_amx_chunk(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                           const uint16_t *x, float *y, int64_t N, int64_t K, int tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    float sums[AMX_TOKENS * groups];  /* S_g of token t at [t · groups + g] */
    for (int t = 0; t < tokens; t++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 a = bf16x16_to_ps(x + t * K + g * GROUP), b = bf16x16_to_ps(x + t * K + g * GROUP + 16);
            sums[t * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
#pragma omp parallel
    {
        configure_tiles(tokens);
        __attribute__((aligned(64))) uint16_t b_tiles[2][16 * 32];  /* B is built one group ahead */
        __attribute__((aligned(64))) float c_tiles[2][AMX_TOKENS * 16];  /* C is scaled one group behind */
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            __m512 acc[AMX_TOKENS];
            for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
            const uint8_t *codes = tiles + nb * groups * 256;
            const uint16_t *block_scale = scale + nb * groups * 16, *block_zero = zero + nb * groups * 16;
            build_b_tile(codes, b_tiles[0]);
            /* Group g: multiply in tile register 2 + g % 2 (constants: the loop is unrolled by two), then
             * store it and apply group g − 1's scales while the tile unit works. groups is even (K % 64). */
            for (int64_t g = 0; g < groups; g += 2) {
#define GROUP_STEP(G, C_TILE)                                                                        \
                if ((G) + 1 < groups) build_b_tile(codes + ((G) + 1) * 256, b_tiles[((G) + 1) & 1]); \
                _tile_loadd(1, b_tiles[(G) & 1], 64);                                                \
                _tile_loadd(0, x + (G) * GROUP, K * 2);                                              \
                _tile_zero(C_TILE);                                                                  \
                _tile_dpbf16ps(C_TILE, 0, 1);                                                        \
                if ((G) > 0) scale_group(c_tiles[((G) - 1) & 1], block_scale, block_zero, sums, groups, \
                                         (G) - 1, tokens, acc);                                               \
                _tile_stored(C_TILE, c_tiles[(G) & 1], 64);
                GROUP_STEP(g, 2)
                GROUP_STEP(g + 1, 3)
#undef GROUP_STEP
            }
            scale_group(c_tiles[(groups - 1) & 1], block_scale, block_zero, sums, groups, groups - 1, tokens, acc);
            for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy + nb * 16, acc[t]);
        }
        _tile_release();
    }
}

void int4_amx_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                     const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += AMX_TOKENS) {
        int chunk = (int)(tokens - t0 < AMX_TOKENS ? tokens - t0 : AMX_TOKENS);
        int4_amx_chunk(tiles, scale, zero, x + t0 * K, y + t0 * N, N, K, chunk, N);
    }
}
