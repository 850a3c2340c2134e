/* Vector helpers shared by the AVX2 kernels (the counterpart of `avx512/vectors.h`): bf16 <-> float32 for 8 lanes,
 * horizontal max and sums, exp. Rounding to bf16 is PyTorch's (nearest, ties to even; NaN stays NaN). */
#ifndef SPECDRAFT_AVX2_VECTORS_H
#define SPECDRAFT_AVX2_VECTORS_H
#pragma once

#include <immintrin.h>
#include <stdint.h>

/* 8 bf16 values -> float32 (exact). */
static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The bf16 bits (nearest, ties to even) of 8 float32 values, in the low 16 bits of each lane. */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

/* To the nearest bf16 (ties to even) and back to float32. */
static inline __m256 round_bf16x8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

/* 8 float32 values stored as bf16 (nearest, ties to even). */
static inline void store_bf16x8(uint16_t *p, __m256 v) {
    const __m256i bits = bf16_bits8(v);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);  /* lanes 0-3, 4-7 */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float reduce_add8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 2^n for integral n in [-252, 254] (two normal factors, so results down to subnormals are right). */
static inline __m256 exp2_integral8(__m256 n) {
    const __m256i whole = _mm256_cvtps_epi32(n);
    const __m256i first = _mm256_srai_epi32(whole, 1), second = _mm256_sub_epi32(whole, first);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(a, b);
}

/* exp(x) for -104 <= x <= 89 (callers clamp): 2^n · p(r) with r = x − n ln 2, |r| <= ln2 / 2, a degree-7
 * polynomial; relative error about 2e-7 (as `exp_reduced` of `avx512/vectors.h`). */
static inline __m256 exp_reduced8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_mul_ps(p, exp2_integral8(n));
}
#endif
