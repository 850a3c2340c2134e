"""Sizes of GGUF's K-quant blocks: facts of the file format, shared by the loaders (`models/gguf_blocks`) and the
kernels (`kernels/gguf_matmul`)."""

QK_K = 256  # weights per K-quant super-block
Q4K_BLOCK_BYTES = 144  # one Q4_K super-block: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes
Q4K_GROUP = 32  # weights per Q4_K sub-block (one scale and one min)
Q6K_BLOCK_BYTES = 210  # one Q6_K super-block: 128 + 64 bytes of codes, 16 scales, d
Q4_0_BLOCK_BYTES = 18  # one Q4_0 block of 32 weights: fp16 d, 16 bytes of codes (w = d · (q − 8))
Q4_1_BLOCK_BYTES = 20  # one Q4_1 block of 32 weights: fp16 d, fp16 m, 16 bytes of codes (w = d · q + m)
Q5_0_BLOCK_BYTES = 22  # 32 weights: fp16 d, 4 bytes of fifth bits, 16 bytes of low nibbles (w = d · (q − 16))
Q5_1_BLOCK_BYTES = 24  # 32 weights: fp16 d, fp16 m, 4 bytes of fifth bits, 16 of low nibbles (w = d · q + m)
Q8_0_BLOCK_BYTES = 34  # 32 weights: fp16 d, 32 int8 codes (w = d · q)
Q5K_BLOCK_BYTES = 176  # 256 weights: d, dmin, 12 bytes of 6-bit scales and mins, 32 bytes of fifth bits, 128 of nibbles
IQ4_NL_BLOCK_BYTES = 18  # 32 weights: fp16 d, 16 bytes of nibbles indexing IQ4_VALUES (w = d · value)
IQ4_XS_BLOCK_BYTES = 136  # 256 weights: fp16 d, 2 + 4 bytes of 6-bit sub-block scales, 128 bytes of nibbles
# the 16 values an IQ4_NL / IQ4_XS nibble stands for (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
