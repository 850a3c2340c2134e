/* Few-query attention over a bf16 key/value cache in AVX2 (the counterpart of `avx512/attention.h`, same layouts,
 * same rules): scores q · k in float32 (bf16 products are exact in float32, summed over 8 lanes), scaled, plus the
 * additive mask; keys the mask hides (-1e30 or less) skipped, so a tree node agrees bit for bit with the same token
 * decoded in a chain; softmax with the row's maximum and a polynomial exp; Σ p v in float32, divided by Σ p once,
 * rounded to bf16. Each query head of each token is computed alone, in an order that does not depend on the pass,
 * so a verify pass agrees bit for bit with one-token decoding. d % 32 == 0, d <= 256. Soft-capped scores (Gemma 2:
 * `softcap` > 0) become softcap · tanh(score / softcap) before the mask is added, as in the AVX-512 file.
 *
 * A work item (across OpenMP threads) is one query token and up to GROUP_HEADS query heads that read the same
 * key/value head (grouped-query attention: 6 of 12 heads on the 1.5B target, 7 of 14 on the 0.5B draft): each key
 * and value row is converted from bf16 once for all of them, not once per head. 1.4-1.5x faster than a head at a
 * time over 300 and 1,200 keys, the same bits (one thread, Zen 3).
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "vectors.h"
#include "../shared/normal_exp.h"

#define MAX_DIM 256
#define HIDDEN_BELOW (-1e30f)  /* mask values at or below this hide a key */
#define VALUE_LANES 8          /* output vectors accumulated per sweep over the keys (64 values) */

/* exp(x) for x <= 0; 0 below NORMAL_EXP_FLOOR (see there). */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(NORMAL_EXP_FLOOR), _CMP_GE_OQ);
    return _mm256_and_ps(normal, exp_reduced8(_mm256_max_ps(x, _mm256_set1_ps(NORMAL_EXP_FLOOR))));
}

/* scores[0 .. count) = cap · tanh(scores / cap), with tanh(y) = sign(y) (1 − e) / (1 + e), e = exp(−2 |y|) (as
 * `soft_cap_scores` of `avx512/attention.h`: an absolute error of about 1e-7 · cap). */
static void soft_cap_scores(float *scores, int64_t count, float cap) {
    const __m256 divisor = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f), minus_two = _mm256_set1_ps(-2.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t s = 0; s < count; s += 8) {
        float lanes[8] = {0};
        const int64_t n = count - s < 8 ? count - s : 8;
        for (int64_t j = 0; j < n; j++) lanes[j] = scores[s + j];
        const __m256 y = _mm256_div_ps(_mm256_loadu_ps(lanes), divisor);
        const __m256 e = exp_nonpositive8(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign, y)));
        const __m256 magnitude = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(lanes, _mm256_mul_ps(_mm256_or_ps(magnitude, _mm256_and_ps(y, sign)), divisor));
        for (int64_t j = 0; j < n; j++) scores[s + j] = lanes[j];
    }
}

#define GROUP_HEADS 4  /* query heads of one key/value head that a pass over the keys takes together */
#include "../shared/attention_items.h"

/* The scores of `n` query heads against one key row: per head two FMA chains over the lanes (even, odd), summed once. */
static inline __attribute__((always_inline)) void score_heads(const __m256 *qv, int n, const uint16_t *row, int64_t lanes,
                                                             __m256 sums[GROUP_HEADS]) {
    __m256 even[GROUP_HEADS], odd[GROUP_HEADS];  /* two chains a head: FMA latency */
    for (int h = 0; h < n; h++) even[h] = odd[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < lanes; c += 2) {
        const __m256 k0 = bf16x8_to_ps(row + 8 * c), k1 = bf16x8_to_ps(row + 8 * c + 8);  /* once for every head */
        for (int h = 0; h < n; h++) {
            even[h] = _mm256_fmadd_ps(qv[h * (MAX_DIM / 8) + c], k0, even[h]);
            odd[h] = _mm256_fmadd_ps(qv[h * (MAX_DIM / 8) + c + 1], k1, odd[h]);
        }
    }
    for (int h = 0; h < n; h++) sums[h] = _mm256_add_ps(even[h], odd[h]);
}

/* Σ_j p_j v_j for `n` heads over `width` lanes from lane c0 (n · width accumulators in registers), each value row
 * converted once for every head; scaled by 1 / Σ p of its head and rounded to bf16 into out (heads `dim` apart). */
static inline __attribute__((always_inline)) void weigh_values(const float *scores, int64_t stride, int n, const uint16_t *v,
                                                              const int32_t *rows, int64_t keys, int64_t dim, int64_t c0,
                                                              int width, const __m256 *scale, uint16_t *out) {
    __m256 acc[GROUP_HEADS][VALUE_LANES];
    for (int h = 0; h < n; h++)
        for (int c = 0; c < width; c++) acc[h][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        const uint16_t *row = v + (int64_t)rows[j] * dim + 8 * c0;
        __m256 p[GROUP_HEADS];
        for (int h = 0; h < n; h++) p[h] = _mm256_set1_ps(scores[h * stride + j]);
        for (int c = 0; c < width; c++) {
            const __m256 value = bf16x8_to_ps(row + 8 * c);
            for (int h = 0; h < n; h++) acc[h][c] = _mm256_fmadd_ps(p[h], value, acc[h][c]);
        }
    }
    for (int h = 0; h < n; h++)
        for (int c = 0; c < width; c++) store_bf16x8(out + h * dim + 8 * (c0 + c), _mm256_mul_ps(acc[h][c], scale[h]));
}

/* `n` (1..GROUP_HEADS) query heads of one query token that read the same key/value head: q rows `q_stride` apart,
 * out rows `dim` apart. Each head gets what it would alone, bit for bit (the same operations in the same order per
 * head); each key and value row is converted to float32 once for all n. scores [n][keys + 8] and rows [keys]: scratch.
 * softcap: 0, or the cap of the scores (`soft_cap_scores`). */
static void attend_heads(const uint16_t *q, int n, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                         const float *mask, uint16_t *out, int64_t keys, int64_t dim, float scaling, float softcap,
                         float *scores, int32_t *rows) {
    const int64_t lanes = dim / 8, stride = keys + 8;
    __m256 qv[GROUP_HEADS * (MAX_DIM / 8)];
    for (int h = 0; h < n; h++)
        for (int64_t c = 0; c < lanes; c++) qv[h * (MAX_DIM / 8) + c] = bf16x8_to_ps(q + h * q_stride + 8 * c);
    float best[GROUP_HEADS];
    for (int h = 0; h < n; h++) best[h] = -__builtin_inff();
    int skip_hidden = 0;  /* a row that sees no key keeps them all (uniform weights, as PyTorch's path) */
    for (int64_t s = 0; mask && s < keys && !skip_hidden; s++) skip_hidden = mask[s] > HIDDEN_BELOW;
    int64_t visible = 0;
    for (int64_t s = 0; s < keys; s++) {
        if (skip_hidden && mask[s] <= HIDDEN_BELOW) continue;
        __m256 sums[GROUP_HEADS];
        switch (n) {  /* a constant count, so the chains stay in registers */
            case 1: score_heads(qv, 1, k + s * dim, lanes, sums); break;
            case 2: score_heads(qv, 2, k + s * dim, lanes, sums); break;
            case 3: score_heads(qv, 3, k + s * dim, lanes, sums); break;
            default: score_heads(qv, 4, k + s * dim, lanes, sums); break;
        }
        for (int h = 0; h < n; h++) {
            if (softcap) {  /* capped below, then masked */
                scores[h * stride + visible] = reduce_add8(sums[h]) * scaling;
                continue;
            }
            const float score = reduce_add8(sums[h]) * scaling + (mask ? mask[s] : 0.0f);
            scores[h * stride + visible] = score;
            best[h] = score > best[h] ? score : best[h];
        }
        rows[visible++] = (int32_t)s;
    }
    keys = visible;
    if (softcap)
        for (int h = 0; h < n; h++) {
            float *row_scores = scores + h * stride;
            soft_cap_scores(row_scores, keys, softcap);
            for (int64_t j = 0; j < keys; j++) {
                row_scores[j] += mask ? mask[rows[j]] : 0.0f;
                best[h] = row_scores[j] > best[h] ? row_scores[j] : best[h];
            }
        }
    __m256 scale[GROUP_HEADS];
    for (int h = 0; h < n; h++) {
        float *row_scores = scores + h * stride;
        const __m256 top = _mm256_set1_ps(best[h]);
        __m256 total = _mm256_setzero_ps();
        int64_t s = 0;
        for (; s + 8 <= keys; s += 8) {
            const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row_scores + s), top));
            _mm256_storeu_ps(row_scores + s, e);
            total = _mm256_add_ps(total, e);
        }
        if (s < keys) {  /* the tail: lanes past the keys count zero */
            float tail[8];
            for (int j = 0; j < 8; j++) tail[j] = s + j < keys ? row_scores[s + j] : best[h];
            const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)(keys - s)), _CMP_LT_OQ);
            const __m256 e = _mm256_and_ps(live, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(tail), top)));
            _mm256_storeu_ps(tail, e);
            for (int j = 0; s + j < keys; j++) row_scores[s + j] = tail[j];
            total = _mm256_add_ps(total, e);
        }
        scale[h] = _mm256_set1_ps(1.0f / reduce_add8(total));
    }
    /* lanes a sweep over the values takes: as many accumulators as registers allow for n heads */
    const int width = VALUE_LANES / (n >= 3 ? 4 : n);  /* 8, 4, 2, 2: lanes is a multiple of 4 */
    for (int64_t c0 = 0; c0 < lanes; c0 += width) {
        if (lanes - c0 < width)  /* one head of 32 values: a short sweep */
            weigh_values(scores, stride, n, v, rows, keys, dim, c0, (int)(lanes - c0), scale, out);
        else if (n == 1)
            weigh_values(scores, stride, 1, v, rows, keys, dim, c0, VALUE_LANES, scale, out);
        else if (n == 2)
            weigh_values(scores, stride, 2, v, rows, keys, dim, c0, VALUE_LANES / 2, scale, out);
        else if (n == 3)
            weigh_values(scores, stride, 3, v, rows, keys, dim, c0, VALUE_LANES / 4, scale, out);
        else
            weigh_values(scores, stride, 4, v, rows, keys, dim, c0, VALUE_LANES / 4, scale, out);
    }
}

/* q [heads][T][d], k and v rows of d with `kv_stride` elements between key/value heads, mask [T][keys] or NULL ->
 * out [T][heads][d]. */
void few_query_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *mask, uint16_t *out,
                              int64_t heads, int64_t kv_heads, int64_t tokens, int64_t keys, int64_t dim,
                              int64_t kv_stride, float scaling, float softcap) {
    const HeadChunks chunks = head_chunks(heads / kv_heads);
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(GROUP_HEADS * (keys + 8)));
        int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)keys);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < work_items(chunks, kv_heads, tokens); item++) {
            int64_t t, kv, h;
            const int n = work_item(chunks, tokens, item, &t, &kv, &h);
            attend_heads(q + (h * tokens + t) * dim, n, tokens * dim, k + kv * kv_stride, v + kv * kv_stride,
                         mask ? mask + t * keys : NULL, out + (t * heads + h) * dim, keys, dim, scaling, softcap, scores,
                         rows);
        }
        free(scores);
        free(rows);
    }
}
