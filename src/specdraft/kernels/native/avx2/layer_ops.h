/* The per-token decoder-layer operations of `avx512/layer_ops.h` (RMSNorm, rotary embedding) in AVX2, for CPUs without
 * AVX-512: the same definitions and roundings, 8 lanes at a time (so the sum of squares adds in another order: a
 * row's norm may differ from the AVX-512 build's in the last bit, never from itself in another pass).
 *
 * rms_norm_bf16: y = w ⊙ bf16(x / sqrt(mean(x²) + eps)) per row, rounded to bf16; rows of `dim` (a multiple of 8).
 * rms_norm_gain_bf16: y = bf16(x / sqrt(mean(x²) + eps) · g) per row, float32 gains g (Gemma's 1 + w), rounded once.
 * rotary_bf16: x·cos + rotate_half(x)·sin in place on the first `heads` heads of each token's row, every product and
 * the sum rounded to bf16 (transformers' bf16 bits); dim / 2 a multiple of 8.
 */
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vectors.h"

/* 1 / sqrt(mean(x²) + eps) of a row of `dim` bf16 values, the squares summed over 8 lanes in a fixed order. */
static inline __m256 inverse_rms8(const uint16_t *row, int64_t dim, float eps) {
    __m256 squares = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
        const __m256 v = bf16x8_to_ps(row + c);
        squares = _mm256_fmadd_ps(v, v, squares);
    }
    return _mm256_set1_ps(1.0f / sqrtf(reduce_add8(squares) / (float)dim + eps));
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        const __m256 scale = inverse_rms8(row, dim, eps);
        for (int64_t c = 0; c < dim; c += 8) {
            const __m256 normed = round_bf16x8(_mm256_mul_ps(bf16x8_to_ps(row + c), scale));
            store_bf16x8(y + r * dim + c, _mm256_mul_ps(normed, bf16x8_to_ps(weight + c)));
        }
    }
}

void rms_norm_gain_bf16(const uint16_t *x, const float *gain, uint16_t *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        const __m256 scale = inverse_rms8(row, dim, eps);
        for (int64_t c = 0; c < dim; c += 8)
            store_bf16x8(y + r * dim + c, _mm256_mul_ps(_mm256_mul_ps(bf16x8_to_ps(row + c), scale),
                                                        _mm256_loadu_ps(gain + c)));
    }
}

void rotary_bf16(uint16_t *rows, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim,
                 const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = rows + t * row_stride + h * dim;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 first = bf16x8_to_ps(x + i), second = bf16x8_to_ps(x + half + i);
                const __m256 out1 = _mm256_sub_ps(round_bf16x8(_mm256_mul_ps(first, bf16x8_to_ps(c + i))),
                                                  round_bf16x8(_mm256_mul_ps(second, bf16x8_to_ps(s + i))));
                const __m256 out2 = _mm256_add_ps(round_bf16x8(_mm256_mul_ps(second, bf16x8_to_ps(c + half + i))),
                                                  round_bf16x8(_mm256_mul_ps(first, bf16x8_to_ps(s + half + i))));
                store_bf16x8(x + i, out1);
                store_bf16x8(x + half + i, out2);
            }
        }
    }
}
