/* Where the attention files' softmax stops computing exp (`exp_nonpositive` of `avx512/attention.h`,
 * `exp_nonpositive8` of `avx2/attention.h`).
 *
 * exp(x) below ln(FLT_MIN) = -87.34 is a subnormal float, and every multiply-add that reads a subnormal takes a
 * microcode assist (about a hundred cycles): a key scored 87 below the row's best then costs a value row of assists.
 * Random-weight models and real ones with attention sinks score so: on a random Llama-3.2-3B shape at 600 cached tokens
 * the attention took most of a four-token pass (a layer's 24 heads over 600 keys: 12.4 ms against 0.84 ms with
 * ordinary scores). So a weight below exp(NORMAL_EXP_FLOOR) (1.6e-38) counts exactly zero. Next to the row's best key,
 * whose weight is 1, such a weight is below float32's resolution of the sum: the softmax's total is the same float;
 * only a value row some 10^30 times larger than the others' could move the output.
 */
#ifndef SPECDRAFT_NORMAL_EXP_H
#define SPECDRAFT_NORMAL_EXP_H
#pragma once

#define NORMAL_EXP_FLOOR (-87.0f)  /* exp(-87) = 1.6e-38, the least normal float32 is 1.2e-38 */

#endif
