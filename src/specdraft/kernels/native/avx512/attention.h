/* Attention of a few bf16 query tokens over a bf16 key/value cache, with AVX-512 BF16.
 *
 * Why: a decoding step, a verify pass and a tree pass each attend with 1 to 64 queries over the
 * whole cache. In PyTorch that is two float32 batched matmuls and a softmax after converting the
 * cache to float32 (`attention.few_query_attention`): 85 µs a layer at 300 keys for one query on
 * a 2-core AMD EPYC, mostly conversions, allocations and dispatch.
 *
 * How: one work item per (query head, query token), split across OpenMP threads. A score is
 * q · k in float32 with `vdpbf16ps` (bf16 products are exact in float32), scaled, plus the
 * additive float32 mask; the softmax uses the row's maximum and a polynomial exp (relative
 * error about 2e-7); the output is Σ p v accumulated in float32, divided by Σ p once, rounded
 * to bf16 (nearest even). Each item is computed alone, in an order that does not depend on the
 * number of queries, so a verify pass agrees bit for bit with one-token decoding. Keys that the
 * mask hides (an additive value of -1e30 or less: -inf, or transformers' float minimum) are
 * skipped, not given zero weight: the visible keys are summed in their own order at the same
 * vector lanes as in a causal pass, so a tree node that sees the cache and its ancestors agrees bit
 * for bit with the same token decoded after them (its ancestors sit at other cache rows; summed
 * with zeros between them, the exp sum fell on other lanes and parted from a chain's in the last
 * bits, which turned greedy choices at near-ties).
 *
 * Soft-capped scores (Gemma 2: `softcap` > 0): each scaled score q · k · scaling becomes softcap · tanh(score / softcap)
 * before the mask is added (transformers' eager attention, in float32; `soft_cap_scores`); 0 leaves them as they are.
 *
 * Layouts: q [heads][T][d] contiguous; k and v: rows of d contiguous, `kv_stride` elements
 * between heads (a cache cut back in place keeps its capacity); mask [T][S] or NULL; out
 * [T][heads][d]. Query head h reads key/value head h / (heads / kv_heads). d % 32 == 0, d <= 256.
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "vectors.h"
#include "../shared/normal_exp.h"
#include <stdlib.h>

#define MAX_DIM 256

/* exp(x) for x <= 0, relative error about 2e-7; 0 below NORMAL_EXP_FLOOR (see there). */
static inline __m512 exp_nonpositive(__m512 x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(NORMAL_EXP_FLOOR), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(normal, exp_reduced(_mm512_max_ps(x, _mm512_set1_ps(NORMAL_EXP_FLOOR))));
}

#define HIDDEN_BELOW (-1e30f)  /* mask values at or below this hide a key */

/* scores[0 .. count) = cap · tanh(scores / cap), with tanh(y) = sign(y) (1 − e) / (1 + e), e = exp(−2 |y|): an
 * absolute error of about 1e-7 · cap (a score's own float32 rounding is about 6e-8 of it). */
static void soft_cap_scores(float *scores, int64_t count, float cap) {
    const __m512 divisor = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.0f), minus_two = _mm512_set1_ps(-2.0f);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t s = 0; s < count; s += 16) {
        const __mmask16 live = count - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - s)) - 1);
        const __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(live, scores + s), divisor);
        const __m512 e = exp_nonpositive(_mm512_mul_ps(minus_two, _mm512_abs_ps(y)));
        const __m512 magnitude = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        const __m512 tanh = _mm512_or_ps(magnitude, _mm512_and_ps(y, sign));
        _mm512_mask_storeu_ps(scores + s, live, _mm512_mul_ps(tanh, divisor));
    }
}

/* scores [keys + 16] and rows [keys]: scratch. softcap: 0, or the cap of the scores (`soft_cap_scores`). */
static void attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *mask, uint16_t *out,
                       int64_t keys, int64_t dim, float scaling, float softcap, float *scores, int32_t *rows) {
    const int64_t chunks = dim / 32;
    __m512i qv[MAX_DIM / 32];
    for (int64_t c = 0; c < chunks; c++) qv[c] = _mm512_loadu_si512((const void *)(q + 32 * c));
    float best = -__builtin_inff();
    int skip_hidden = 0;  /* a row that sees no key keeps them all (uniform weights, as PyTorch's path) */
    for (int64_t s = 0; mask && s < keys && !skip_hidden; s++) skip_hidden = mask[s] > HIDDEN_BELOW;
    int64_t visible = 0;  /* the keys that count, their rows in `rows` and scores in `scores`, in order */
    for (int64_t s = 0; s < keys; s++) {
        if (skip_hidden && mask[s] <= HIDDEN_BELOW) continue;
        const uint16_t *row = k + s * dim;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512((const void *)(row + 32 * c)));
        rows[visible] = (int32_t)s;
        if (softcap) {  /* capped below, then masked */
            scores[visible++] = _mm512_reduce_add_ps(acc) * scaling;
            continue;
        }
        float score = _mm512_reduce_add_ps(acc) * scaling + (mask ? mask[s] : 0.0f);
        scores[visible++] = score;
        best = score > best ? score : best;
    }
    keys = visible;
    if (softcap) {
        soft_cap_scores(scores, keys, softcap);
        for (int64_t j = 0; j < keys; j++) {
            scores[j] += mask ? mask[rows[j]] : 0.0f;
            best = scores[j] > best ? scores[j] : best;
        }
    }
    const __m512 top = _mm512_set1_ps(best);
    __m512 total = _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + 16 <= keys; s += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + s), top));
        _mm512_storeu_ps(scores + s, e);
        total = _mm512_add_ps(total, e);
    }
    if (s < keys) {
        __mmask16 tail = (__mmask16)((1u << (keys - s)) - 1);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + s), top));
        e = _mm512_maskz_mov_ps(tail, e);
        _mm512_mask_storeu_ps(scores + s, tail, e);
        total = _mm512_add_ps(total, e);
    }
    const float inverse = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[MAX_DIM / 16];
    const int64_t lanes = dim / 16;
    for (int64_t c = 0; c < lanes; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        const __m512 p = _mm512_set1_ps(scores[j]);
        const uint16_t *row = v + (int64_t)rows[j] * dim;
        for (int64_t c = 0; c < lanes; c++) acc[c] = _mm512_fmadd_ps(p, bf16x16_to_ps(row + 16 * c), acc[c]);
    }
    const __m512 scale = _mm512_set1_ps(inverse);
    for (int64_t c = 0; c < lanes; c++)
        _mm256_storeu_si256((__m256i *)(out + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[c], scale)));
}

/* What the decoder stack (`shared/decoder_layers.h`) takes from an attention file: here a work item is one query head
 * (GROUP_HEADS 1), as in `few_query_attention_bf16` below. */
#define GROUP_HEADS 1
#include "../shared/attention_items.h"

/* One query head (n is 1; q_stride unused). */
static inline void attend_heads(const uint16_t *q, int n, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                const float *mask, uint16_t *out, int64_t keys, int64_t dim, float scaling, float softcap,
                                float *scores, int32_t *rows) {
    (void)n, (void)q_stride;
    attend_one(q, k, v, mask, out, keys, dim, scaling, softcap, scores, rows);
}

void few_query_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *mask, uint16_t *out,
                              int64_t heads, int64_t kv_heads, int64_t tokens, int64_t keys, int64_t dim,
                              int64_t kv_stride, float scaling, float softcap) {
    const int64_t groups = heads / kv_heads;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(keys + 16));
        int32_t *rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)keys);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < heads * tokens; item++) {
            const int64_t h = item / tokens, t = item % tokens, kv = h / groups;
            attend_one(q + (h * tokens + t) * dim, k + kv * kv_stride, v + kv * kv_stride,
                       mask ? mask + t * keys : NULL, out + (t * heads + h) * dim, keys, dim, scaling, softcap, scores,
                       rows);
        }
        free(scores);
        free(rows);
    }
}
