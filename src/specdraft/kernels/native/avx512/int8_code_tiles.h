/* Weights that are int8 values times a step per 32, as the file stores them, times bf16 activations, on AVX-512:
 * `q8_0_matmul`, `iq4_matmul`, and `code_passes` for the decoder stack (run kinds 9 and 10). The tiles are the AVX2
 * library's (`kernels/int8_codes.pack_codes`, the layout in `avx2/int8_code_tiles.h`: tiles of 8 rows x 32 inputs,
 * [N/8][K/32][tile]), and so is the function, term for term: each token's activations on an int16 grid per 16
 * inputs, x = 2^e · x̂ (e = floor(log2 max|x|) − 14), exact integer sums Σ q·x̂ per 16 inputs, then in float32
 *   y += (step·2^e) ⊙ Σ q·x̂
 * per 16 inputs in input order, so both levels give the same bits. Here two blocks of 8 rows meet in one 512-bit
 * vector (block 2i in its low half, 2i + 1 in its high one: two streams of memory), so a `vpdpwssd` does 32
 * multiply-adds; a last block without a partner computes its 8 rows alone.
 */
#pragma once

#include "tiles.h"
#include "../shared/stored_layout.h"

/* Token activations on the int16 grid per 16 inputs, in the code tiles' pair order (dword 4·(i / 8) + i % 4 of a
 * token's 16 inputs holds (x̂[i], x̂[i + 4]) for i % 8 < 4): x [tokens, K] bf16 -> x̂ [tokens, K], 2^e [tokens, K/16]. */
typedef struct {
    int16_t *x;
    float *scale;
} CodeActivations;

static CodeActivations code_activations(const uint16_t *x, int64_t K, int64_t tokens) {
    const int64_t parts = K / SUB;
    CodeActivations act = {malloc(sizeof(int16_t) * (size_t)(tokens * K)), malloc(sizeof(float) * (size_t)(tokens * parts))};
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i pair_order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (int64_t i = 0; i < tokens * parts; i++) {
        const __m512 v = bf16x16_to_ps(x + i * SUB);
        const float amax = _mm512_reduce_max_ps(_mm512_andnot_ps(sign, v));
        /* e = floor(log2 max|x|) − 14, so that max|x| / 2^e lies in [2^14, 2^15) */
        const float e = amax > 0.0f ? _mm_cvtss_f32(_mm_getexp_ss(_mm_set_ss(amax), _mm_set_ss(amax))) - 14.0f : 0.0f;
        const __m512i q = _mm512_cvtps_epi32(_mm512_scalef_ps(v, _mm512_set1_ps(-e)));  /* nearest, ties even */
        _mm256_storeu_si256((__m256i *)(act.x + i * SUB), _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(pair_order, q)));
        act.scale[i] = _mm_cvtss_f32(_mm_scalef_ss(_mm_set_ss(1.0f), _mm_set_ss(e)));  /* 2^e */
    }
    return act;
}

static void release_code_activations(CodeActivations act) {
    free(act.x);
    free(act.scale);
}

/* The four pair steps of chunk `chunk` of two tiles (a: rows 0-7, b: rows 8-15), as int16 code pairs: dword lane c of
 * rows[p] = (q[c][8·chunk + p], q[c][8·chunk + 4 + p]). */
static inline __attribute__((always_inline)) void code_pairs16(const uint8_t *a, const uint8_t *b, int chunk, int format,
                                                              __m512i rows[4]) {
    if (format == CODES_Q8_0) {
        for (int p = 0; p < 4; p++)
            rows[p] = _mm512_cvtepi8_epi16(_mm256_loadu2_m128i((const __m128i *)(b + 64 * chunk + 16 * p),
                                                               (const __m128i *)(a + 64 * chunk + 16 * p)));
        return;
    }
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i *)(b + 32 * chunk + 16 * h), (const __m128i *)(a + 32 * chunk + 16 * h));
        rows[2 * h] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(v, low)));
        rows[2 * h + 1] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)));
    }
}

/* Fetch every line of both blocks' tiles of group g + D, D = ahead / (2 · tile bytes) groups on; past the last group,
 * the next pair's (two blocks on: a thread's pairs run through memory in order, each a then b, so one stream ahead of
 * each block would fetch b's tiles while they are read, and the next pair's late). */
static inline __attribute__((always_inline)) void prefetch_pair(const uint8_t *a, const uint8_t *b, int64_t g,
                                                               int64_t groups, int tile_bytes, int ahead) {
    int64_t at = g + ahead / (2 * tile_bytes), skip = 0;
    if (at >= groups) {
        at -= groups;
        skip = 2 * groups * tile_bytes;
    }
    prefetch_ahead(a + skip + at * tile_bytes, tile_bytes, 0);
    prefetch_ahead(b + skip + at * tile_bytes, tile_bytes, 0);
}

/* Two blocks of 8 output rows (`a`, `b`: their tiles and steps) against `tokens` tokens (constants after inlining), the
 * activations from token `first` of `act` on; y's 16 columns: a's rows, then b's. */
static inline __attribute__((always_inline)) void code_rows16(const uint8_t *a, const uint8_t *b, const void *steps_a,
                                                             const void *steps_b, int format,
                                                             const CodeActivations *act, int64_t first, int64_t K,
                                                             int64_t groups, int tokens, float *y, int64_t ldy,
                                                             __mmask16 columns, int ahead) {
    const int tile_bytes = format == CODES_Q8_0 ? Q8_0_TILE_BYTES : IQ4_TILE_BYTES;
    __m512 acc[MAX_TOKENS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tile_a = a + g * tile_bytes, *tile_b = b + g * tile_bytes;
        prefetch_pair(a, b, g, groups, tile_bytes, ahead);
        const __m512 step = format == CODES_Q8_0
            ? _mm512_cvtph_ps(_mm256_loadu2_m128i((const __m128i *)((const uint16_t *)steps_b + g * 8),
                                                  (const __m128i *)((const uint16_t *)steps_a + g * 8)))
            : _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)steps_a + g * 8)),
                                 _mm256_loadu_ps((const float *)steps_b + g * 8), 1);
        const int16_t *xg = act->x + first * K + g * GROUP;
        for (int part = 0; part < 2; part++) {  /* inputs 16·part .. 16·part + 15: chunks 2·part, 2·part + 1 */
            __m512i sum[MAX_TOKENS];
            for (int t = 0; t < tokens; t++) sum[t] = _mm512_setzero_si512();
            for (int chunk = 2 * part; chunk < 2 * part + 2; chunk++) {
                __m512i rows[4];
                code_pairs16(tile_a, tile_b, chunk, format, rows);
                for (int p = 0; p < 4; p++)
                    for (int t = 0; t < tokens; t++) {  /* the dword (x̂[8·chunk + p], x̂[8·chunk + 4 + p]) */
                        const int32_t *xp = (const int32_t *)(xg + t * K + 8 * chunk + 2 * p);
                        sum[t] = _mm512_dpwssd_epi32(sum[t], rows[p], _mm512_set1_epi32(xp[0]));
                    }
            }
            for (int t = 0; t < tokens; t++) {
                const float scale = act->scale[(first + t) * 2 * groups + 2 * g + part];
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(step, _mm512_set1_ps(scale)), _mm512_cvtepi32_ps(sum[t]), acc[t]);
            }
        }
    }
    for (int t = 0; t < tokens; t++) _mm512_mask_storeu_ps(y + t * ldy, columns, acc[t]);
}

/* y [tokens, N] float32 (rows `ldy` apart) = x [tokens, K] bf16 · W^T, W in code tiles of `format` (`steps` fp16 for
 * Q8_0, float32 for IQ4); K % 32 == 0, N % 8 == 0. The tokens are taken in spans whose activations fit in L2; in a
 * span each pair of 8-row blocks meets MAX_TOKENS tokens at a time while its codes stay in L1/L2. */
static void code_passes(const uint8_t *tiles, const void *steps, int format, const uint16_t *x, float *y, int64_t N,
                        int64_t K, int64_t tokens, int64_t ldy) {
    const int64_t groups = K / GROUP, blocks = N / 8, pairs = (blocks + 1) / 2;
    const int tile_bytes = format == CODES_Q8_0 ? Q8_0_TILE_BYTES : IQ4_TILE_BYTES;
    const int step_bytes = format == CODES_Q8_0 ? 2 : 4;
    const int64_t fit = CODE_SPAN_BYTES / (2 * K), span = fit < MAX_TOKENS ? MAX_TOKENS : fit - fit % MAX_TOKENS;
    const int ahead = tokens <= PREFETCH_FAR_TOKENS ? PREFETCH_BYTES : PREFETCH_NEAR_BYTES;
    const CodeActivations act = code_activations(x, K, tokens);
    for (int64_t s0 = 0; s0 < tokens; s0 += span) {
        const int64_t s1 = tokens - s0 < span ? tokens : s0 + span;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t na = 2 * i, nb = 2 * i + 1 < blocks ? 2 * i + 1 : 2 * i;  /* a last block alone: itself twice */
            const __mmask16 columns = 2 * i + 1 < blocks ? 0xFFFF : 0x00FF;
            const uint8_t *a = tiles + na * groups * tile_bytes, *b = tiles + nb * groups * tile_bytes;
            const void *steps_a = (const uint8_t *)steps + na * groups * 8 * step_bytes;
            const void *steps_b = (const uint8_t *)steps + nb * groups * 8 * step_bytes;
            for (int64_t t0 = s0; t0 < s1; t0 += MAX_TOKENS) {
                const int chunk = (int)(s1 - t0 < MAX_TOKENS ? s1 - t0 : MAX_TOKENS);
                float *out = y + t0 * ldy + na * 8;
                if (format == CODES_Q8_0) {
#define Q8_0_ROWS(T) code_rows16(a, b, steps_a, steps_b, CODES_Q8_0, &act, t0, K, groups, T, out, ldy, columns, ahead)
                    WITH_CONSTANT_TOKENS(chunk, Q8_0_ROWS)
#undef Q8_0_ROWS
                } else {
#define IQ4_ROWS(T) code_rows16(a, b, steps_a, steps_b, CODES_IQ4, &act, t0, K, groups, T, out, ldy, columns, ahead)
                    WITH_CONSTANT_TOKENS(chunk, IQ4_ROWS)
#undef IQ4_ROWS
                }
            }
        }
    }
    release_code_activations(act);
}
