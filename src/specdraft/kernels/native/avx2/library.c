/* The AVX2 kernels as one library (`kernels/bindings.py` builds and binds it): every slot of the kernel layer, filled
 * with AVX2 + FMA + F16C code (and AVX-VNNI's 256-bit `vpdpbusd` in the build made with -mavxvnni: `NumericConfig.avx_vnni`).
 *
 *   tiles.h        4-bit, 5-bit and Q6_K tiles times bf16 activations on an int16 grid: int4_matmul, int5_matmul,
 *                  q6k_matmul
 *   int8_tiles.h   the same tiles times int8 activations (its `affine_q8_passes`; the entry points in
 *                  ../shared/int8_entries.h): int4_q8_matmul, int5_q8_matmul, q6k_q8_matmul
 *   ../shared/dense_tiles.h   F16, BF16 and F32 weights as stored: f16_matmul, bf16_matmul,
 *                             f32_matmul
 *   int8_code_tiles.h   Q8_0 and IQ4 weights as stored, on int16 activations: code_passes
 *   q4k_tiles.h    Q4_K, Q5_K and Q4_0 weights as stored, on int8 activations per 256 inputs: q4k_passes
 *   ../shared/stored_entries.h   q8_0_matmul, iq4_matmul, q4k_matmul, q5k_matmul, q4_0_matmul over the two headers above
 *   layer_ops.h    rms_norm_bf16, rms_norm_gain_bf16, rotary_bf16
 *   attention.h    few_query_attention_bf16 (and attend_heads for the decoder stack)
 *   decoder_ops.h  the decoder stack's elementwise steps: use_exp, silu_mul_bf16, act_mul_bf16, residuals
 *   ../shared/decoder_layers.h   decoder_layers_forward, use_int8_activations: the layer, written once
 */
#include "tiles.h"
#include "int8_tiles.h"
#include "../shared/int8_entries.h"
#include "../shared/dense_tiles.h"
#include "int8_code_tiles.h"
#include "q4k_tiles.h"
#include "../shared/stored_entries.h"
#include "layer_ops.h"
#include "attention.h"
#include "decoder_ops.h"
#include "../shared/decoder_layers.h"
