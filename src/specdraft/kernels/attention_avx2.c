/* Few-query attention over a bf16 key/value cache in AVX2 (the counterpart of `attention_avx512.c`, same layouts,
 * same rules): one work item per (query head, query token) across OpenMP threads; scores q · k in float32 (bf16
 * products are exact in float32, summed over 8 lanes), scaled, plus the additive mask; keys the mask hides (-1e30 or
 * less) skipped, so a tree node agrees bit for bit with the same token decoded in a chain; softmax with the row's
 * maximum and a polynomial exp; Σ p v in float32, divided by Σ p once, rounded to bf16. Each item is computed alone,
 * so a verify pass agrees bit for bit with one-token decoding. d % 32 == 0, d <= 256.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_vectors.h"

#define MAX_DIM 256
#define HIDDEN_BELOW (-1e30f)  /* mask values at or below this hide a key */
#define VALUE_LANES 8          /* output vectors accumulated per sweep over the keys (64 values) */

/* exp(x) for x <= 0 (x below -100 gives about 0). */
static inline __m256 exp_nonpositive8(__m256 x) { return exp_reduced8(_mm256_max_ps(x, _mm256_set1_ps(-100.0f))); }

/* scores [keys + 8] and rows [keys]: scratch. */
static void attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *mask, uint16_t *out,
                       int64_t keys, int64_t dim, float scaling, float *scores, int32_t *rows) {
    const int64_t lanes = dim / 8;
    __m256 qv[MAX_DIM / 8];
    for (int64_t c = 0; c < lanes; c++) qv[c] = bf16x8_to_ps(q + 8 * c);
    float best = -__builtin_inff();
    int skip_hidden = 0;  /* a row that sees no key keeps them all (uniform weights, as PyTorch's path) */
    for (int64_t s = 0; mask && s < keys && !skip_hidden; s++) skip_hidden = mask[s] > HIDDEN_BELOW;
    int64_t visible = 0;
    for (int64_t s = 0; s < keys; s++) {
        if (skip_hidden && mask[s] <= HIDDEN_BELOW) continue;
        const uint16_t *row = k + s * dim;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();  /* two chains: FMA latency */
        for (int64_t c = 0; c < lanes; c += 2) {
            even = _mm256_fmadd_ps(qv[c], bf16x8_to_ps(row + 8 * c), even);
            odd = _mm256_fmadd_ps(qv[c + 1], bf16x8_to_ps(row + 8 * c + 8), odd);
        }
        const float score = reduce_add8(_mm256_add_ps(even, odd)) * scaling + (mask ? mask[s] : 0.0f);
        scores[visible] = score;
        rows[visible++] = (int32_t)s;
        best = score > best ? score : best;
    }
    keys = visible;
    const __m256 top = _mm256_set1_ps(best);
    __m256 total = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= keys; s += 8) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), top));
        _mm256_storeu_ps(scores + s, e);
        total = _mm256_add_ps(total, e);
    }
    if (s < keys) {  /* the tail: lanes past the keys count zero */
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = s + j < keys ? scores[s + j] : best;
        const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(keys - s)), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(live, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(tail), top)));
        _mm256_storeu_ps(tail, e);
        for (int j = 0; s + j < keys; j++) scores[s + j] = tail[j];
        total = _mm256_add_ps(total, e);
    }
    const __m256 scale = _mm256_set1_ps(1.0f / reduce_add8(total));
    for (int64_t c0 = 0; c0 < lanes; c0 += VALUE_LANES) {  /* 64 output values per sweep: the accumulators stay in registers */
        const int64_t width = lanes - c0 < VALUE_LANES ? lanes - c0 : VALUE_LANES;
        __m256 acc[VALUE_LANES];
        for (int64_t c = 0; c < width; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            const __m256 p = _mm256_set1_ps(scores[j]);
            const uint16_t *row = v + (int64_t)rows[j] * dim + 8 * c0;
            for (int64_t c = 0; c < width; c++) acc[c] = _mm256_fmadd_ps(p, bf16x8_to_ps(row + 8 * c), acc[c]);
        }
        for (int64_t c = 0; c < width; c++) store_bf16x8(out + 8 * (c0 + c), _mm256_mul_ps(acc[c], scale));
    }
}

void few_query_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *mask, uint16_t *out,
                              int64_t heads, int64_t kv_heads, int64_t tokens, int64_t keys, int64_t dim,
                              int64_t kv_stride, float scaling) {
    const int64_t groups = heads / kv_heads;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(keys + 8));
        int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)keys);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < heads * tokens; item++) {
            const int64_t h = item / tokens, t = item % tokens, kv = h / groups;
            attend_one(q + (h * tokens + t) * dim, k + kv * kv_stride, v + kv * kv_stride,
                       mask ? mask + t * keys : NULL, out + (t * heads + h) * dim, keys, dim, scaling, scores, rows);
        }
        free(scores);
        free(rows);
    }
}
