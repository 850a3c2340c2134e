/* The int8-activation slots `int4_q8_matmul`, `int5_q8_matmul` and `q6k_q8_matmul`, written once over the including
 * library's `affine_q8_passes` (its `int8_tiles.h`: the tokens from `first` on, on int8 activations) and its
 * 16-bit `int4_matmul` / `int5_matmul` / `q6k_matmul` (the leading `precise_tokens`: a sequence's first token, see
 * `prompt_pass.py`). */
#pragma once

#include <stdint.h>

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in 4-bit tiles (`int4_layout`); K % 32 == 0, N % 16 == 0. */
void int4_q8_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x, float *y,
                    int64_t N, int64_t K, int64_t tokens, int64_t precise_tokens) {
    precise_tokens = precise_tokens < tokens ? precise_tokens : tokens;
    int4_matmul(tiles, scale, zero, x, y, N, K, precise_tokens);
    affine_q8_passes(tiles, scale, zero, x, y, N, K, precise_tokens, tokens, N, 4);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in Q6_K tiles; K % 256 == 0, N % 16 == 0. */
void q6k_q8_matmul(const uint8_t *tiles, const float *d, const uint16_t *x, float *y, int64_t N, int64_t K,
                   int64_t tokens, int64_t precise_tokens) {
    precise_tokens = precise_tokens < tokens ? precise_tokens : tokens;
    q6k_matmul(tiles, d, x, y, N, K, precise_tokens);
    affine_q8_passes(tiles, d, NULL, x, y, N, K, precise_tokens, tokens, N, 4);
}

/* y [tokens, N] float32 = x [tokens, K] bf16 · W^T, W in 5-bit tiles (`int4_layout`, bits 5). */
void int5_q8_matmul(const uint8_t *tiles, const uint16_t *scale, const uint16_t *zero, const uint16_t *x, float *y,
                    int64_t N, int64_t K, int64_t tokens, int64_t precise_tokens) {
    precise_tokens = precise_tokens < tokens ? precise_tokens : tokens;
    int5_matmul(tiles, scale, zero, x, y, N, K, precise_tokens);
    affine_q8_passes(tiles, scale, zero, x, y, N, K, precise_tokens, tokens, N, 5);
}
