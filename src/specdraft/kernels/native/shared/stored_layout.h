/* The tile layouts of weights kept as the file stores them, one for every library that multiplies them
 * (`kernels/int8_codes.pack_codes`, `kernels/q4k_tiles.pack_q4k`, `kernels/q4k_tiles.pack_q4_0`; each layout spelled out
 * in `avx2/int8_code_tiles.h` and `avx2/q4k_tiles.h`). */
#pragma once

#include <stdint.h>

#define Q8_0_TILE_BYTES 256
#define IQ4_TILE_BYTES 128
#define CODE_SPAN_BYTES (256 * 1024)  /* int16 activations of the tokens one sweep over the rows takes */

enum { CODES_Q8_0 = 0, CODES_IQ4 = 1 };  /* the formats; the decoder's run kinds 9, 10 in order */

/* The int8 values IQ4_NL and IQ4_XS index (llama.cpp's `kvalues_iq4nl`). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#define Q4K_SUPER 256
#define Q4K_GROUPS 8            /* groups of 32 in a super-block */
#define Q4K_MARK_BYTES 256      /* scales and mins of a super-block of 16 rows */
#define Q4K_STEP_HALFWORDS 32   /* d and dmin of a super-block of 16 rows */
#define Q4_0_STEP_HALFWORDS 16  /* d of a group of 32 inputs of 16 rows (Q4_0 tiles) */

/* The formats of the `QUADS` tiles kept with their file's steps (`q4k_tiles.h`): Q4_K and Q5_K (4- or 5-bit codes,
 * each super-block's 6-bit scales and mins, fp16 d and dmin) and Q4_0 and Q5_0 (4- or 5-bit codes, each group's
 * fp16 d: w = d·(q − 8) or d·(q − 16)); the decoder's run kinds 11, 13, 12 and 14. */
enum { TILES_Q4_K = 0, TILES_Q5_K = 1, TILES_Q4_0 = 2, TILES_Q5_0 = 3 };

static inline int stored_bits(int format) { return format == TILES_Q5_K || format == TILES_Q5_0 ? 5 : 4; }

/* Whether `format` keeps a step per group (Q4_0, Q5_0: its activations take an int8 scale per 32 inputs, llama.cpp's
 * Q8_0) rather than per super-block (Q4_K, Q5_K: per 256, Q8_K). */
static inline int stored_per_group(int format) { return format == TILES_Q4_0 || format == TILES_Q5_0; }

/* The step halfwords of a block of 16 rows of K inputs in `format`. */
static inline int64_t stored_block_halfwords(int format, int64_t K) {
    return stored_per_group(format) ? K / 32 * Q4_0_STEP_HALFWORDS : K / Q4K_SUPER * Q4K_STEP_HALFWORDS;
}
