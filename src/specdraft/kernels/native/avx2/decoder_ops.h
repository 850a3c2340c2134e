/* The stack of decoder layers of `avx512/decoder_ops.h` for CPUs with AVX2 and no AVX-512: the same
 * layer (`shared/decoder_layers.h`) on the AVX2 kernels (`avx2/tiles.h`, `avx2/layer_ops.h`, `avx2/attention.h`),
 * with the roundings of the PyTorch path on the same kernels, so a pass gives that path's bits:
 *   - projections in float32 (on int16 activations, or int8 ones after `use_int8_activations(1)`), plus the
 *     bias in float32, rounded to bf16 (nearest even);
 *   - residual sums of two bf16 values in float32, rounded to bf16;
 *   - SiLU as PyTorch computes it for bf16, x / (1 + exp(−x)) in float32 with PyTorch's own 8-lane exp
 *     (`use_exp`), rounded; times up, rounded; another activation read from a table of PyTorch's own values.
 * Each token is computed alone, so decoding, chain verification and tree passes agree bit for bit.
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"


/* exp of 8 float32 values: PyTorch's (`Sleef_expf8_u10`, what its SiLU uses on AVX2) once `use_exp` hands its
 * address over, else `exp_reduced8` (relative error about 2e-7). */
typedef __m256 (*exp8_function)(__m256);
static exp8_function exp8 = NULL;

void use_exp(void *function) { exp8 = (exp8_function)function; }

static inline __m256 exp_ps8(__m256 x) {
    if (exp8) return exp8(x);
    return exp_reduced8(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f)));
}

/* out [rows][inter] = bf16(bf16(silu(gate)) · up), gate_up [rows][2·inter] bf16 (gate first); inter % 8 == 0. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t c = 0; c < inter; c += 8) {
            const __m256 g = bf16x8_to_ps(gate + c);
            const __m256 silu = round_bf16x8(_mm256_div_ps(g, _mm256_add_ps(one, exp_ps8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
            store_bf16x8(out + r * inter + c, _mm256_mul_ps(silu, bf16x8_to_ps(up + c)));
        }
    }
}

/* out [rows][inter] = bf16(act(gate) · up), act(gate) read from `table` (as in `avx512/decoder_ops.h`); inter % 8 == 0. */
void act_mul_bf16(const uint16_t *gate_up, const uint16_t *table, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t c = 0; c < inter; c += 8) {
            const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gate + c)));
            const __m256i act = _mm256_i32gather_epi32((const int *)table, bits, 2);  /* the entry in the low half */
            store_bf16x8(out + r * inter + c, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(act, 16)),
                                                           bf16x8_to_ps(up + c)));
        }
    }
}

/* y [n] += bias [n], float32; n % 8 == 0. */
static void add_bias(float *y, const float *bias, int64_t n) {
    for (int64_t c = 0; c < n; c += 8) _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_loadu_ps(bias + c)));
}

/* dest [n] bf16 = bf16(src [n] float32); n % 8 == 0. */
static void to_bf16(const float *src, uint16_t *dest, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) store_bf16x8(dest + i, _mm256_loadu_ps(src + i));
}

/* hidden [n] = bf16(hidden + bf16(src)); n % 8 == 0. */
static void add_residual(uint16_t *hidden, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        store_bf16x8(hidden + i, _mm256_add_ps(bf16x8_to_ps(hidden + i), round_bf16x8(_mm256_loadu_ps(src + i))));
}

/* hidden [n] = bf16(hidden + src), src [n] bf16; n % 8 == 0. */
static void add_residual_bf16(uint16_t *hidden, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        store_bf16x8(hidden + i, _mm256_add_ps(bf16x8_to_ps(hidden + i), bf16x8_to_ps(src + i)));
}
