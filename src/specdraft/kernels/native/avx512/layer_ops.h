/* Small per-token operations of a decoder layer in AVX-512, for bf16 activations on the CPU.
 *
 * Why: PyTorch runs an RMSNorm as seven dispatched ops (to float32, pow, mean, add, rsqrt, mul,
 * back to bf16, times the weight); a 1.5B model has 57 norms a step, about 1.4 ms of a 31 ms
 * decoding step on 2 cores, for work worth microseconds.
 *
 * rms_norm_bf16: y = w ⊙ bf16(x / sqrt(mean(x²) + eps)) per row, rounded to bf16 (nearest even)
 * as transformers' Qwen2/Llama RMSNorm rounds; the sum of squares is float32 in a fixed order, so
 * a row's result does not depend on the other rows of the pass. Rows of `dim` (a multiple of 16).
 *
 * rms_norm_gain_bf16: y = bf16(x / sqrt(mean(x²) + eps) · g) per row with float32 gains g (Gemma's 1 + w): both
 * products in float32, rounded once, as transformers' Gemma RMSNorm rounds; the same sum of squares.
 *
 * rotary_bf16: rotary position embedding in place on the first `heads` heads of each token's row
 * (a stacked q|k|v projection's q and k heads), x·cos + rotate_half(x)·sin with every product and
 * the sum rounded to bf16, as transformers' bf16 ops round them (the same bits). cos and sin are
 * [tokens][dim]; dim / 2 a multiple of 16.
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "vectors.h"

/* 1 / sqrt(mean(x²) + eps) of a row of `dim` bf16 values, the squares summed over 16 lanes in a fixed order. */
static inline __m512 inverse_rms(const uint16_t *row, int64_t dim, float eps) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
        __m512 v = bf16x16_to_ps(row + c);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    return _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        const __m512 scale = inverse_rms(row, dim, eps);
        for (int64_t c = 0; c < dim; c += 16) {
            __m512 normed = round_bf16(_mm512_mul_ps(bf16x16_to_ps(row + c), scale));
            __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(normed, bf16x16_to_ps(weight + c)));
            _mm256_storeu_si256((__m256i *)(y + r * dim + c), out);
        }
    }
}

void rms_norm_gain_bf16(const uint16_t *x, const float *gain, uint16_t *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * dim;
        const __m512 scale = inverse_rms(row, dim, eps);
        for (int64_t c = 0; c < dim; c += 16)
            store_bf16x16(y + r * dim + c, _mm512_mul_ps(_mm512_mul_ps(bf16x16_to_ps(row + c), scale),
                                                         _mm512_loadu_ps(gain + c)));
    }
}

void rotary_bf16(uint16_t *rows, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim,
                 const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = rows + t * row_stride + h * dim;
            for (int64_t i = 0; i < half; i += 16) {
                __m512 first = bf16x16_to_ps(x + i), second = bf16x16_to_ps(x + half + i);
                __m512 out1 = _mm512_sub_ps(round_bf16(_mm512_mul_ps(first, bf16x16_to_ps(c + i))),
                                            round_bf16(_mm512_mul_ps(second, bf16x16_to_ps(s + i))));
                __m512 out2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(second, bf16x16_to_ps(c + half + i))),
                                            round_bf16(_mm512_mul_ps(first, bf16x16_to_ps(s + half + i))));
                _mm256_storeu_si256((__m256i *)(x + i), (__m256i)_mm512_cvtneps_pbh(out1));
                _mm256_storeu_si256((__m256i *)(x + half + i), (__m256i)_mm512_cvtneps_pbh(out2));
            }
        }
    }
}
