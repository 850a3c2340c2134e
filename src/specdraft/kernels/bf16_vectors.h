/* bf16 <-> float32 vector helpers shared by the AVX-512 kernels (included by each .c file). */
#ifndef SPECDRAFT_BF16_VECTORS_H
#define SPECDRAFT_BF16_VECTORS_H
#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 values -> float32 (exact). */
static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* To the nearest bf16 (ties to even) and back to float32. */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* 16 float32 values stored as bf16 (nearest, ties to even). */
static inline void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif
