/* A whole stack of decoder layers (Llama's shape, or Gemma's with its sandwich norms) for a pass of a few bf16 tokens,
 * in one C call.
 *
 * Why: with every matrix on the tile kernels, a decoding step of the bundled 1.5B target spent
 * about 4.6 of 27 ms (the 0.5B draft 3.9 of 11 ms) outside the kernels: Python module calls,
 * PyTorch dispatch, conversions and allocations, some 20 operations a layer. Here a layer is
 * norm -> stacked q|k|v -> rotary -> cache append -> attention -> o -> residual -> norm ->
 * stacked gate|up -> SiLU·up -> down -> residual, calling the same kernels as the PyTorch path
 * (`avx512/tiles.h` and `avx512/int8_tiles.h`, `avx512/layer_ops.h`, `avx512/attention.h`, included below) with the same
 * roundings:
 *   - projections in float32 (on int16 activations, or int8 ones after `use_int8_activations(1)`), plus the
 *     bias in float32, rounded to bf16 (nearest even);
 *   - residual sums of two bf16 values in float32, rounded to bf16;
 *   - SiLU as PyTorch computes it for bf16, x / (1 + exp(−x)) in float32 with PyTorch's own exp
 *     (`use_exp`), rounded; times up, rounded; another activation (Gemma's GELU) read from a table of PyTorch's
 *     own values for every bf16 input (`act_mul_bf16`), times up, rounded.
 * So a pass gives the PyTorch path's bits. Each token is computed alone (attention included), so
 * decoding, chain verification and tree passes agree with each other bit for bit.
 *
 * Attention: token t of the pass sees the cache and the pass up to itself (keys cache_len + t + 1,
 * no mask), or, given `mask` [T][cache_len + T] (additive float32), every key under its mask.
 * The key/value caches are [kv_heads][capacity][head_dim] bf16 per layer; the pass's keys and
 * values are written at cache_len .. cache_len + T - 1 (the caller makes room).
 */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"


/* exp of 16 float32 values. PyTorch's SiLU uses SLEEF's `Sleef_expf16_u10` (exported by libtorch_cpu);
 * `use_exp` hands its address over so that SiLU here gives the same bits. Until then (or where it is
 * missing) `exp_reduced` stands in (relative error about 2e-7). */
typedef __m512 (*exp16_function)(__m512);
static exp16_function exp16 = NULL;

void use_exp(void *function) { exp16 = (exp16_function)function; }

static inline __m512 exp_ps(__m512 x) {
    if (exp16) return exp16(x);
    return exp_reduced(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f)));
}

/* out [rows][inter] = bf16(bf16(silu(gate)) · up), gate_up [rows][2·inter] bf16 (gate first); inter % 16 == 0. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t c = 0; c < inter; c += 16) {
            const __m512 g = bf16x16_to_ps(gate + c);
            const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16x16(out + r * inter + c, _mm512_mul_ps(silu, bf16x16_to_ps(up + c)));
        }
    }
}

/* out [rows][inter] = bf16(act(gate) · up), act(gate) read from `table` (the bf16 bits of PyTorch's own activation of
 * every bf16 value, `decoder_layers.activation_table`: 65,537 entries, the last padding for the 4-byte gathers), gate_up
 * [rows][2·inter] bf16 (gate first); inter % 16 == 0. */
void act_mul_bf16(const uint16_t *gate_up, const uint16_t *table, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t c = 0; c < inter; c += 16) {
            const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + c)));
            const __m512i act = _mm512_i32gather_epi32(bits, (const void *)table, 2);  /* the entry in the low half */
            store_bf16x16(out + r * inter + c, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(act, 16)),
                                                            bf16x16_to_ps(up + c)));
        }
    }
}

/* y [n] += bias [n], float32; n % 16 == 0. */
static void add_bias(float *y, const float *bias, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) _mm512_storeu_ps(y + c, _mm512_add_ps(_mm512_loadu_ps(y + c), _mm512_loadu_ps(bias + c)));
}

/* dest [n] bf16 = bf16(src [n] float32); n % 16 == 0. */
static void to_bf16(const float *src, uint16_t *dest, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) store_bf16x16(dest + i, _mm512_loadu_ps(src + i));
}

/* hidden [n] = bf16(hidden + bf16(src)); n % 16 == 0. */
static void add_residual(uint16_t *hidden, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        store_bf16x16(hidden + i, _mm512_add_ps(bf16x16_to_ps(hidden + i), round_bf16(_mm512_loadu_ps(src + i))));
}

/* hidden [n] = bf16(hidden + src), src [n] bf16; n % 16 == 0. */
static void add_residual_bf16(uint16_t *hidden, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        store_bf16x16(hidden + i, _mm512_add_ps(bf16x16_to_ps(hidden + i), bf16x16_to_ps(src + i)));
}
