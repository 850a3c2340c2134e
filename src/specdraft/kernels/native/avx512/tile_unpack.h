/* Unpacking of the tile layouts (`int4_layout.py`, `gguf_matmul.pack_q6k`) into vectors of 16-bit code
 * pairs, shared by the AVX-512 kernels (`avx512/tiles.h`: int16 q, operands of `vpdpwssd`) and the AMX ones
 * (`avx512/amx_tiles.h`: bf16 128 + q, rows of B tiles). Integer ops only: a code q < 128 becomes the 16 bits
 * (high << 8) | q, so high = INT16_CODES gives the integer q and high = BF16_CODES the bf16 number 128 + q. */
#ifndef SPECDRAFT_TILE_UNPACK_H
#define SPECDRAFT_TILE_UNPACK_H
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* 64 bytes of nibbles -> the code pairs of four pair vectors as bytes: `pairs[0]` holds those of
 * pairs 4·chunk and 4·chunk + 1 of a tile, `pairs[1]` of 4·chunk + 2 and 4·chunk + 3. */
static inline __attribute__((always_inline)) void nibble_pairs(const uint8_t *bytes, __m512i pairs[2]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i v = _mm512_loadu_si512((const void *)bytes);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    pairs[0] = _mm512_unpacklo_epi8(lo, hi);
    pairs[1] = _mm512_unpackhi_epi8(lo, hi);
}

#define INT16_CODES 0x00  /* high byte of a code q as the int16 q */
#define BF16_CODES 0x43   /* high byte of a code q as the bf16 number 128 + q */

/* Code bytes (q < 128) -> four vectors of 16-bit code pairs (high byte `high`): dword lane c = (w'[c][2r], w'[c][2r + 1]). */
static inline __attribute__((always_inline)) void code_pair_rows(const __m512i pairs[2], int high, __m512i rows[4]) {
    const __m512i top = _mm512_set1_epi8((char)high);
    rows[0] = _mm512_unpacklo_epi8(pairs[0], top);
    rows[1] = _mm512_unpackhi_epi8(pairs[0], top);
    rows[2] = _mm512_unpacklo_epi8(pairs[1], top);
    rows[3] = _mm512_unpackhi_epi8(pairs[1], top);
}

/* Four vectors of 16-bit code pairs, pairs 4·chunk .. 4·chunk + 3 of a 4-bit tile, from its 64 bytes. */
static inline __attribute__((always_inline)) void unpack_pairs(const uint8_t *bytes, int high, __m512i rows[4]) {
    __m512i pairs[2];
    nibble_pairs(bytes, pairs);
    code_pair_rows(pairs, high, rows);
}

/* ----- 5-bit tiles (320 bytes: a 4-bit tile's low nibbles, then per 64 of them two 64-bit masks of fifth bits) ----- */
#define INT5_TILE_BYTES 320

/* The 5-bit code bytes of pairs 4·chunk .. 4·chunk + 3 of a 5-bit tile, as `nibble_pairs` lays them out: bit m of the
 * chunk's mask v adds 16 to byte m of pair vector v (`int4_layout._fifth_bit_masks`). */
static inline __attribute__((always_inline)) void five_code_pairs(const uint8_t *tile, int chunk, __m512i pairs[2]) {
    const __m512i fifth = _mm512_set1_epi8(0x10);
    uint64_t masks[2];
    memcpy(masks, tile + 256 + chunk * 16, sizeof(masks));
    nibble_pairs(tile + chunk * 64, pairs);
    pairs[0] = _mm512_mask_add_epi8(pairs[0], _cvtu64_mask64(masks[0]), pairs[0], fifth);
    pairs[1] = _mm512_mask_add_epi8(pairs[1], _cvtu64_mask64(masks[1]), pairs[1], fifth);
}

/* Four vectors of 16-bit code pairs (high byte `high`), pairs 4·chunk .. 4·chunk + 3 of a 5-bit tile. */
static inline __attribute__((always_inline)) void five_unpack_pairs(const uint8_t *tile, int chunk, int high, __m512i rows[4]) {
    __m512i pairs[2];
    five_code_pairs(tile, chunk, pairs);
    code_pair_rows(pairs, high, rows);
}

/* ----- Q6_K tiles (416 bytes: 256 of low nibbles, 128 of high bits, 32 of sub-block scales) ----- */
/* The 6-bit code bytes of pairs 4·chunk .. 4·chunk + 3 of a Q6_K tile, as `nibble_pairs` lays them out. */
static inline __attribute__((always_inline)) void q6_code_pairs(const uint8_t *tile, int chunk, __m512i pairs[2]) {
    const __m512i top = _mm512_set1_epi8(0x30);
    const __m512i shift_a = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  /* left */
    const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);  /* right */
    nibble_pairs(tile + chunk * 64, pairs);
    __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(tile + 256 + chunk * 32)));
    /* (A & B) | C = ternary logic 0xEA: OR the high bits, moved to bits 4-5, into the low nibbles */
    pairs[0] = _mm512_ternarylogic_epi32(_mm512_sllv_epi16(high, shift_a), top, pairs[0], 0xEA);
    pairs[1] = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(high, shift_b), top, pairs[1], 0xEA);
}

/* Four vectors of 16-bit code pairs (high byte `high`), pairs 4·chunk .. 4·chunk + 3 of a Q6_K tile. */
static inline __attribute__((always_inline)) void q6_unpack_pairs(const uint8_t *tile, int chunk, int high, __m512i rows[4]) {
    __m512i pairs[2];
    q6_code_pairs(tile, chunk, pairs);
    code_pair_rows(pairs, high, rows);
}

/* The 16 rows' scales s = d·sc of sub-block `sub` of a tile. */
static inline __m512 q6_scales(const uint8_t *tile, const float *d, int sub) {
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tile + 384 + sub * 16))));
    return _mm512_mul_ps(sc, _mm512_loadu_ps(d));
}

#endif
