/* The slots of weights kept as the file stores them, written once over the including library's drivers: `q8_0_matmul`
 * and `iq4_matmul` over its `int8_code_tiles.h` (`code_passes`), `q4k_matmul`, `q5k_matmul`, `q4_0_matmul` and `q5_0_matmul` over its
 * `q4k_tiles.h`
 * (`q4k_passes`).
 * The AVX2 and AVX-512 libraries fill them with the same function on the same tiles. */
#pragma once

#include <stdint.h>

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in Q8_0 tiles (`d` their fp16 steps). */
void q8_0_matmul(const uint8_t *tiles, const uint16_t *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                 int64_t tokens) {
    code_passes(tiles, d, CODES_Q8_0, x, y, N, K, tokens, N);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in IQ4 tiles (`steps` float32). */
void iq4_matmul(const uint8_t *tiles, const float *steps, const uint16_t *x, float *y, int64_t N, int64_t K,
                int64_t tokens) {
    code_passes(tiles, steps, CODES_IQ4, x, y, N, K, tokens, N);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in Q4_K tiles (`codes`, `marks`, `steps`: the layout in
 * `avx2/q4k_tiles.h`), the first `precise` tokens against the exact weights. */
void q4k_matmul(const uint8_t *codes, const uint8_t *marks, const uint16_t *steps, const uint16_t *x, float *y,
                int64_t N, int64_t K, int64_t tokens, int64_t precise) {
    q4k_passes(codes, marks, steps, x, y, N, K, tokens, N, precise, TILES_Q4_K);
}

/* The same for Q5_K tiles (`codes`: 5-bit tiles, the nibbles and then the fifth bits of each group). */
void q5k_matmul(const uint8_t *codes, const uint8_t *marks, const uint16_t *steps, const uint16_t *x, float *y,
                int64_t N, int64_t K, int64_t tokens, int64_t precise) {
    q4k_passes(codes, marks, steps, x, y, N, K, tokens, N, precise, TILES_Q5_K);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in Q4_0 tiles (`codes`, `steps`: the layout in
 * `avx2/q4k_tiles.h`), the first `precise` tokens against the exact weights. */
void q4_0_matmul(const uint8_t *codes, const uint16_t *steps, const uint16_t *x, float *y, int64_t N, int64_t K,
                 int64_t tokens, int64_t precise) {
    q4k_passes(codes, NULL, steps, x, y, N, K, tokens, N, precise, TILES_Q4_0);
}

/* The same for Q5_0 tiles (`codes`: 5-bit tiles). */
void q5_0_matmul(const uint8_t *codes, const uint16_t *steps, const uint16_t *x, float *y, int64_t N, int64_t K,
                 int64_t tokens, int64_t precise) {
    q4k_passes(codes, NULL, steps, x, y, N, K, tokens, N, precise, TILES_Q5_0);
}
