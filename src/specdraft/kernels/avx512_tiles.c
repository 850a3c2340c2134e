/* AVX-512 kernels with BF16 dot products (`vdpbf16ps`) for weights kept in 4-bit and 6-bit tiles:
 * y = x W^T without unpacking W to float, for CPUs without AMX (AMD Zen 4/5, older Xeons).
 *
 * Why: PyTorch's CPU int4 kernel works on 4 tokens at a time and unpacks every weight again for
 * each 4 (measured on a 2-core AMD EPYC, 28 layers of a 1.5B model: one token 17 ms, 4 tokens
 * 25 ms, 5 tokens 50 ms), while a verify pass carries k + 1 tokens.
 *
 * How: a tile holds 16 output rows x 32 inputs. Its codes become the bf16 numbers 128 + q by
 * integer ops alone (bits 0x4300 | q), as vectors that each hold one input pair (2r, 2r + 1) of
 * the 16 rows: what `vdpbf16ps` multiplies with a broadcast pair of x (and AMX's B tile rows:
 * `amx_tiles.c` shares the 4-bit layout, see `int4_layout.py`). A tile is unpacked once per pass
 * of up to MAX_TOKENS tokens and then costs one dot-product instruction per 32 weights per token.
 * The scales are applied per group in float32 with S = Σ x over the group:
 *   4-bit (w = s·(q − 8) + z, groups of 32):  y += s ⊙ C − (136 s − z) ⊙ S
 *   Q6_K  (w = d·sc·(q − 32), sub-blocks of 16): y += s ⊙ C − 160 s ⊙ S,  s = d·sc
 * with C = Σ x_k (128 + q_k): x · W up to float32 rounding; x is the model's bf16 activations.
 *
 * Each token is computed alone, in the same order whatever the pass width (two accumulator chains
 * per group, added at its end), so a verify pass agrees bit for bit with one-token decoding. A
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
#include <immintrin.h>
#include <stdint.h>

#include <stdlib.h>

#include "bf16_vectors.h"
#include "tile_unpack.h"

#define GROUP 32
#define SUB 16
#define MAX_TOKENS 8
#define INT4_TILE_BYTES 256
#define Q6_TILE_BYTES 416
#define PREFETCH_BYTES 4096  /* codes are fetched this far ahead, every line of a tile */

/* ----- 4-bit tiles (`int4_layout`) ---------------------------------------------------------- */
/* Fetch every line of the tile PREFETCH_BYTES ahead of `tile`. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *tile, int tile_bytes) {
    for (int line = 0; line < tile_bytes; line += 64)
        _mm_prefetch((const char *)(tile + PREFETCH_BYTES + line), _MM_HINT_T0);
}

/* `call(T)` with T = tokens as a constant (1..MAX_TOKENS), so the accumulators stay in registers. */
#define WITH_CONSTANT_TOKENS(tokens, call)                                                     \
    switch (tokens) {                                                                          \
        case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;                \
        case 4: call(4); break; case 5: call(5); break; case 6: call(6); break;                \
        case 7: call(7); break; default: call(8); break;                                       \
    }

/* One block of 16 output rows against `tokens` tokens (a constant after inlining). */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *codes, const uint16_t *block_scale,
                                                            const uint16_t *block_zero, const uint16_t *x,
                                                            const float *sums, int64_t K, int64_t groups,
                                                            int tokens, float *y, int64_t ldy) {
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group_codes = codes + g * INT4_TILE_BYTES;
        prefetch_ahead(group_codes, INT4_TILE_BYTES);
        __m512 even[MAX_TOKENS], odd[MAX_TOKENS];
        for (int t = 0; t < tokens; t++) even[t] = odd[t] = _mm512_setzero_ps();
        const uint16_t *xg = x + g * GROUP;
        for (int chunk = 0; chunk < 4; chunk++) {
            __m512i rows[4];
            unpack_pairs(group_codes + chunk * 64, rows);
            for (int j = 0; j < 4; j += 2) {
                const int pair = 4 * chunk + j;
                for (int t = 0; t < tokens; t++) {
                    const int32_t *xp = (const int32_t *)(xg + t * K + 2 * pair);
                    even[t] = _mm512_dpbf16_ps(even[t], (__m512bh)rows[j], (__m512bh)_mm512_set1_epi32(xp[0]));
                    odd[t] = _mm512_dpbf16_ps(odd[t], (__m512bh)rows[j + 1], (__m512bh)_mm512_set1_epi32(xp[1]));
                }
            }
        }
        const __m512 s = bf16x16_to_ps(block_scale + g * 16), z = bf16x16_to_ps(block_zero + g * 16);
        const __m512 offset = _mm512_fmsub_ps(s, _mm512_set1_ps(136.0f), z);
        for (int t = 0; t < tokens; t++) {
            acc[t] = _mm512_fmadd_ps(s, _mm512_add_ps(even[t], odd[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[t * groups + g]), acc[t]);
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

/* x [tokens, K] bf16 -> y [tokens, N] float32 (rows `ldy` apart); tokens <= MAX_TOKENS, K % 32 == 0, N % 16 == 0. */
static void int4_chunk(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x,
                       float *y, int64_t N, int64_t K, int tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    float *sums = malloc(sizeof(float) * MAX_TOKENS * groups);  /* S_g of token t at [t · groups + g] */
    for (int t = 0; t < tokens; t++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 a = bf16x16_to_ps(x + t * K + g * GROUP), b = bf16x16_to_ps(x + t * K + g * GROUP + 16);
            sums[t * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        const uint8_t *codes = tiles + nb * groups * 256;
        const uint16_t *bs = scale + nb * groups * 16, *bz = zero + nb * groups * 16;
        float *out = y + nb * 16;
#define INT4_BLOCK(T) block_rows(codes, bs, bz, x, sums, K, groups, T, out, ldy)
        WITH_CONSTANT_TOKENS(tokens, INT4_BLOCK)
#undef INT4_BLOCK
    }
    free(sums);
}

void int4_avx512_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero,
                        const uint16_t *x, float *y, int64_t N, int64_t K, int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        int4_chunk(tiles, scale, zero, x + t0 * K, y + t0 * N, N, K, chunk, N);
    }
}

/* ----- Q6_K tiles ----------------------------------------------------------------------------- */
/* One block of 16 output rows against `tokens` tokens (a constant after inlining). */
static inline __attribute__((always_inline)) void q6_block(const uint8_t *tiles, const float *d, const uint16_t *x,
                                                          const float *sums, int64_t K, int64_t groups, int tokens,
                                                          float *y, int64_t ldy) {
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile = tiles + g * Q6_TILE_BYTES;
        prefetch_ahead(tile, Q6_TILE_BYTES);
        const float *dg = d + (g / 8) * 16;
        for (int sub = 0; sub < 2; sub++) {  /* inputs 16·sub .. 16·sub + 15: chunks 2·sub, 2·sub + 1 */
            __m512 first[MAX_TOKENS], second[MAX_TOKENS];  /* two chains: chunk 2·sub, chunk 2·sub + 1 */
            for (int t = 0; t < tokens; t++) first[t] = second[t] = _mm512_setzero_ps();
            __m512i rows_a[4], rows_b[4];
            q6_unpack_pairs(tile, 2 * sub, rows_a);
            q6_unpack_pairs(tile, 2 * sub + 1, rows_b);
            const uint16_t *xs = x + g * GROUP + sub * SUB;
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < tokens; t++) {
                    const int32_t *xp = (const int32_t *)(xs + t * K);
                    first[t] = _mm512_dpbf16_ps(first[t], (__m512bh)rows_a[j], (__m512bh)_mm512_set1_epi32(xp[j]));
                    second[t] = _mm512_dpbf16_ps(second[t], (__m512bh)rows_b[j], (__m512bh)_mm512_set1_epi32(xp[4 + j]));
                }
            const __m512 s = q6_scales(tile, dg, sub), offset = _mm512_mul_ps(s, _mm512_set1_ps(160.0f));
            for (int t = 0; t < tokens; t++) {
                acc[t] = _mm512_fmadd_ps(s, _mm512_add_ps(first[t], second[t]), acc[t]);
                acc[t] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(sums[t * 2 * groups + 2 * g + sub]), acc[t]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_storeu_ps(y + t * ldy, acc[t]);
}

static void q6_chunk(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                     int tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 16;
    float *sums = malloc(sizeof(float) * MAX_TOKENS * 2 * groups);  /* S of token t, sub-block b at [t · 2G + b] */
    for (int t = 0; t < tokens; t++)
        for (int64_t b = 0; b < 2 * groups; b++)
            sums[t * 2 * groups + b] = _mm512_reduce_add_ps(bf16x16_to_ps(x + t * K + b * SUB));
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < blocks; nb++) {
        const uint8_t *block = tiles + nb * groups * Q6_TILE_BYTES;
        const float *bd = d + nb * (K / 256) * 16;
        float *out = y + nb * 16;
#define Q6_BLOCK(T) q6_block(block, bd, x, sums, K, groups, T, out, ldy)
        WITH_CONSTANT_TOKENS(tokens, Q6_BLOCK)
#undef Q6_BLOCK
    }
    free(sums);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W as Q6_K tiles; K % 256 == 0, N % 16 == 0. */
void q6k_matmul(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                int64_t tokens) {
    for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        int chunk = (int)(tokens - t0 < MAX_TOKENS ? tokens - t0 : MAX_TOKENS);
        q6_chunk(tiles, d, x + t0 * K, y + t0 * N, N, K, chunk, N);
    }
}
