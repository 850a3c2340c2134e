/* The decoder-layer stack of `avx512/decoder_ops.h` and `avx2/decoder_ops.h`, written once: a layer is
 * norm -> stacked q|k|v -> (norms over each head of q and k: Qwen3, Gemma 3) -> rotary -> cache append -> attention
 * (over a sliding window on Gemma's sliding layers; scores soft-capped on Gemma 2's) -> o -> (norm: Gemma's sandwich) -> residual -> norm ->
 * stacked gate|up -> activation·up -> down -> (norm: Gemma's sandwich) -> residual (see `avx512/decoder_ops.h` for why
 * and what each rounds). Norms are Llama's (`rms_norm_bf16`, bf16 weights) or, where `norm_gains`, Gemma's
 * (`rms_norm_gain_bf16`, float32 gains 1 + w). On the way the stack copies out the rows entering the layers a caller
 * names (`keep_features`: an EAGLE-3 head's low, middle and high layers), so such a drafter keeps the fused path.
 *
 * The including file provides, for its instruction set: the tile kernels `affine_chunk` (4- or 5-bit) and `q6_chunk` (and
 * MAX_TOKENS, the tokens they take a call), `rms_norm_bf16`, `rms_norm_gain_bf16`, `rotary_bf16`, `attend_heads`
 * (and through its attention file `shared/attention_items.h`: which query heads a work item takes together),
 * `silu_mul_bf16`, `act_mul_bf16` (an activation read from a table, times up), `add_bias` (y += bias, float32),
 * `to_bf16` (float32 -> bf16), `add_residual` (hidden = bf16(hidden + bf16(src))), `add_residual_bf16`
 * (hidden = bf16(hidden + src), src bf16), `affine_q8_passes` (a 4- or 5-bit or Q6_K matrix times int8
 * activations: `avx2/int8_tiles.h`, `avx512/int8_tiles.h`) and `dense_passes` (F16, BF16 and F32 weights:
 * `shared/dense_tiles.h`).
 */
#ifndef SPECDRAFT_DECODER_LAYERS_H
#define SPECDRAFT_DECODER_LAYERS_H
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RUNS 3

/* A projection's rows in up to MAX_RUNS runs of one kind each (stacked q|k|v may mix 4-bit and Q6_K). */
typedef struct {
    int64_t kind;         /* 0: 4-bit tiles (`int4_layout`), 1: Q6_K tiles (`gguf_matmul.pack_q6k`),
                             2, 3, 4: 4-bit, Q6_K, 5-bit tiles on AMX (`avx512/amx_tiles.h`, in the WITH_AMX build only),
                             5: 5-bit tiles (`int4_layout`, bits 5),
                             6, 7, 8: F16, BF16, F32 weights as stored (`shared/dense_tiles.h`: format kind − 6),
                             9, 10: Q8_0, IQ4 code tiles (`avx2/int8_code_tiles.h`, in the AVX2 library only),
                             11: Q4_K tiles (`avx2/q4k_tiles.h`, `avx512/q4k_tiles.h`),
                             12, 13, 14: Q4_0, Q5_K, Q5_0 tiles (the same headers) */
    const uint8_t *tiles;
    const void *scale;    /* 4- and 5-bit: bf16 scales; Q6_K: float32 d; Q8_0: fp16 d; IQ4: float32 steps;
                             Q4_K, Q5_K: its scales and mins; Q4_0, Q5_0: fp16 d */
    const uint16_t *zero; /* 4- and 5-bit: bf16 zeros; Q4_K, Q5_K: fp16 d and dmin; others: unused */
    int64_t rows;         /* output features of this run */
    int64_t doubled;      /* 1: 4-bit halves side by side (`SplitInt4Linear`), multiplied by [x, x] */
} Run;

typedef struct {
    const float *bias;    /* [out] float32 or NULL */
    int64_t runs;
    Run run[MAX_RUNS];
} Projection;

/* Norm weights (`const void *`): [dim] bf16 weights, or float32 gains where the pass has `norm_gains`. */
typedef struct {
    const void *input_norm, *mlp_norm;        /* [hidden]: the norms before the attention and before the MLP */
    Projection qkv, o, gate_up, down;
    uint16_t *keys, *values;                  /* [kv_heads][capacity][head_dim] bf16 */
    int64_t capacity;                         /* tokens the cache buffers hold room for */
    const void *q_norm, *k_norm;              /* [head_dim], or NULL: RMSNorm over each head of q and of k */
    const void *attention_out_norm, *mlp_out_norm;  /* [hidden], or NULL: norms of the attention's and the MLP's
                                                       outputs before their residual adds (Gemma's sandwich) */
    const uint16_t *cos, *sin;                /* [tokens][head_dim] bf16: the layer's rotary table for the pass */
    int64_t window;                           /* keys a token sees in a causal pass at most (itself and the ones
                                                 before it: a sliding-window layer), or 0: all */
} Layer;

/* y = the RMSNorm of `rows` rows of x, `dim` wide (x == y allowed): Llama's with bf16 weights, Gemma's with float32
 * gains where `gains`. */
static void norm_rows(const uint16_t *x, const void *weight, uint16_t *y, int64_t rows, int64_t dim, float eps,
                      int64_t gains) {
    if (gains)
        rms_norm_gain_bf16(x, (const float *)weight, y, rows, dim, eps);
    else
        rms_norm_bf16(x, (const uint16_t *)weight, y, rows, dim, eps);
}

/* hidden [n] += a sublayer's float32 output `out` [tokens][hidden_size], rounded to bf16: as it is, or normed first
 * where the layer has `norm` there (Gemma's sandwich); scratch: [tokens][hidden_size] bf16. */
static void add_output(uint16_t *hidden, const float *out, const void *norm, uint16_t *scratch, int64_t tokens,
                       int64_t hidden_size, float eps, int64_t gains) {
    if (!norm) {
        add_residual(hidden, out, tokens * hidden_size);
        return;
    }
    to_bf16(out, scratch, tokens * hidden_size);
    norm_rows(scratch, norm, scratch, tokens, hidden_size, eps, gains);
    add_residual_bf16(hidden, scratch, tokens * hidden_size);
}

/* Projections of 4-bit, 5-bit and Q6_K runs on int8 activations (`affine_q8_passes`) while set: every
 * pass of a model whose matmuls run so (`SPECDRAFT_INT8_ACTIVATIONS`), so that the fused layers compute what the PyTorch path computes.
 * Runs on the AMX kernels (kinds 2-4) keep their own way. */
static int int8_activations = 0;

void use_int8_activations(int64_t on) { int8_activations = (int)on; }

/* 1 where the run's rows y [tokens][ldy] were computed here: Q8_0 or IQ4 code tiles (kinds 9, 10: the AVX2 library's
 * `int8_code_tiles.h`, the only one that has them), Q4_K, Q4_0, Q5_K or Q5_0 tiles (kinds 11-14: each library's
 * `q4k_tiles.h`), each on
 * every pass, or 4-bit, 5-bit and Q6_K ones on int8 activations; else 0 (the tile kernels' loop). */
static int project_run(const Run *run, const uint16_t *x, float *y, int64_t tokens, int64_t in, int64_t ldy) {
#ifdef Q8_0_TILE_BYTES
    if (run->kind == 9 || run->kind == 10) {
        code_passes(run->tiles, run->scale, (int)(run->kind - 9), x, y, run->rows, in, tokens, ldy);
        return 1;
    }
#endif
#ifdef Q4K_SUPER
    if (run->kind >= 11 && run->kind <= 14) {  /* Q4_K, Q4_0, Q5_K, Q5_0 */
        static const int formats[4] = {TILES_Q4_K, TILES_Q4_0, TILES_Q5_K, TILES_Q5_0};
        const int format = formats[run->kind - 11];
        const uint8_t *marks = stored_per_group(format) ? NULL : (const uint8_t *)run->scale;
        const uint16_t *steps = stored_per_group(format) ? (const uint16_t *)run->scale : run->zero;
        q4k_passes(run->tiles, marks, steps, x, y, run->rows, in, tokens, ldy, int8_activations ? 0 : tokens, format);
        return 1;
    }
#endif
    if (!int8_activations || (run->kind > 1 && run->kind != 5)) return 0;
    affine_q8_passes(run->tiles, run->scale, run->kind == 1 ? NULL : run->zero, x, y, run->rows, in, 0, tokens, ldy,
                     run->kind == 5 ? 5 : 4);
    return 1;
}

/* y [tokens][out] float32 = x [tokens][in] · Wᵀ (+ bias), each run into its own columns, in passes of
 * as many tokens as its kernel takes; a doubled run reads each token's row twice over ([x, x], 2 in inputs). */
static void project(const Projection *p, const uint16_t *x_once, float *y, int64_t tokens, int64_t in_once, int64_t out) {
    int64_t column = 0;
    uint16_t *twice = NULL;
    for (int64_t i = 0; i < p->runs; i++) {
        const Run *run = &p->run[i];
        const uint16_t *x = x_once;
        int64_t in = in_once;
        if (run->doubled) {
            if (!twice) {
                twice = malloc(sizeof(uint16_t) * tokens * 2 * in_once);
                for (int64_t t = 0; t < tokens; t++) {
                    memcpy(twice + t * 2 * in_once, x_once + t * in_once, sizeof(uint16_t) * in_once);
                    memcpy(twice + t * 2 * in_once + in_once, x_once + t * in_once, sizeof(uint16_t) * in_once);
                }
            }
            x = twice;
            in = 2 * in_once;
        }
        if (run->kind >= 6 && run->kind <= 8) {  /* F16 / BF16 / F32 weights as stored: every pass in float32 */
            dense_passes(run->tiles, (int)(run->kind - 6), x, y + column, run->rows, in, tokens, out);
            column += run->rows;
            continue;
        }
        if (project_run(run, x, y + column, tokens, in, out)) {  /* the includer ran the whole run its own way */
            column += run->rows;
            continue;
        }
#ifdef WITH_AMX
        const int64_t width = run->kind >= 2 && run->kind <= 4 ? AMX_TOKENS : MAX_TOKENS;  /* kinds 2-4: AMX */
#else
        const int64_t width = MAX_TOKENS;
#endif
        for (int64_t t0 = 0; t0 < tokens; t0 += width) {
            const int chunk = (int)(tokens - t0 < width ? tokens - t0 : width);
            float *dest = y + t0 * out + column;
            if (run->kind == 0 || run->kind == 5)
                affine_chunk(run->tiles, (const uint16_t *)run->scale, run->zero, x + t0 * in, dest, run->rows, in, chunk,
                             out, run->kind == 5 ? 5 : 4);
            else if (run->kind == 1)
                q6_chunk(run->tiles, (const float *)run->scale, x + t0 * in, dest, run->rows, in, chunk, out);
#ifdef WITH_AMX
            else if (run->kind == 2 || run->kind == 4)
                affine_amx_chunk(run->tiles, (const uint16_t *)run->scale, run->zero, x + t0 * in, dest, run->rows, in,
                                 chunk, out, run->kind == 4 ? 5 : 4);
            else
                q6k_amx_chunk(run->tiles, (const float *)run->scale, x + t0 * in, dest, run->rows, in, chunk, out);
#endif
        }
        column += run->rows;
    }
    free(twice);
    if (p->bias)
        for (int64_t t = 0; t < tokens; t++) add_bias(y + t * out, p->bias, out);
}

/* Where `layer` is one of the `feature_count` indices of `feature_layers`, the rows of `hidden` [tokens][hidden_size]
 * as they enter it (transformers' hidden_states[layer]) into its column block of `features`
 * [tokens][feature_count * hidden_size] bf16: what an EAGLE-3 head reads of the pass. */
static void keep_features(const uint16_t *hidden, int64_t layer, const int64_t *feature_layers, int64_t feature_count,
                          uint16_t *features, int64_t tokens, int64_t hidden_size) {
    for (int64_t i = 0; i < feature_count; i++)
        if (feature_layers[i] == layer)
            for (int64_t t = 0; t < tokens; t++)
                memcpy(features + (t * feature_count + i) * hidden_size, hidden + t * hidden_size,
                       sizeof(uint16_t) * hidden_size);
}

/* Run `hidden` [tokens][hidden_size] bf16 through `count` layers in place. `activation`: NULL for SiLU, else the table
 * of another activation (`act_mul_bf16`). `softcap`: 0, or the cap of the attention's scores (Gemma 2).
 * `feature_layers` [feature_count] (0 of them: none): layers whose input rows are copied into `features` on the way
 * (`keep_features`). */
void decoder_layers_forward(const Layer *layers, int64_t count, uint16_t *hidden, int64_t tokens,
                            int64_t hidden_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t intermediate, float eps, float scaling, float softcap, int64_t cache_len,
                            int64_t norm_gains, const uint16_t *activation, const float *mask,
                            const int64_t *feature_layers, int64_t feature_count, uint16_t *features) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const int64_t total = cache_len + tokens;
    const HeadChunks chunks = head_chunks(heads / kv_heads);
    const int64_t widest = qkv_size > 2 * intermediate ? qkv_size : 2 * intermediate;
    uint16_t *normed = malloc(sizeof(uint16_t) * tokens * hidden_size);
    uint16_t *qkv = malloc(sizeof(uint16_t) * tokens * qkv_size);
    uint16_t *attended = malloc(sizeof(uint16_t) * tokens * q_size);
    uint16_t *gate_up = malloc(sizeof(uint16_t) * tokens * 2 * intermediate);
    uint16_t *activated = malloc(sizeof(uint16_t) * tokens * intermediate);
    float *projected = malloc(sizeof(float) * tokens * (widest > hidden_size ? widest : hidden_size));
    for (int64_t l = 0; l < count; l++) {
        const Layer *layer = &layers[l];
        keep_features(hidden, l, feature_layers, feature_count, features, tokens, hidden_size);
        norm_rows(hidden, layer->input_norm, normed, tokens, hidden_size, eps, norm_gains);
        project(&layer->qkv, normed, projected, tokens, hidden_size, qkv_size);
        to_bf16(projected, qkv, tokens * qkv_size);
        if (layer->q_norm)
            for (int64_t t = 0; t < tokens; t++) {  /* in place: a row is read before it is written */
                uint16_t *row = qkv + t * qkv_size;
                norm_rows(row, layer->q_norm, row, heads, head_dim, eps, norm_gains);
                norm_rows(row + q_size, layer->k_norm, row + q_size, kv_heads, head_dim, eps, norm_gains);
            }
        rotary_bf16(qkv, tokens, qkv_size, heads + kv_heads, head_dim, layer->cos, layer->sin);
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t slot = (h * layer->capacity + cache_len + t) * head_dim;
                memcpy(layer->keys + slot, qkv + t * qkv_size + q_size + h * head_dim, sizeof(uint16_t) * head_dim);
                memcpy(layer->values + slot, qkv + t * qkv_size + q_size + kv_size + h * head_dim, sizeof(uint16_t) * head_dim);
            }
#pragma omp parallel
        {
            float *scores = malloc(sizeof(float) * (size_t)(GROUP_HEADS * (total + 16)));
            int32_t *rows = malloc(sizeof(int32_t) * (size_t)total);
#pragma omp for schedule(static)
            for (int64_t item = 0; item < work_items(chunks, kv_heads, tokens); item++) {
                int64_t t, kv, h;
                const int n = work_item(chunks, tokens, item, &t, &kv, &h);
                /* the keys token t sees: all under its mask, or itself and the ones before it, the last `window` of
                 * them on a sliding layer (a masked pass never reaches past a window: `CausalLM` refuses it) */
                const int64_t seen = mask ? total : cache_len + t + 1;
                const int64_t first = !mask && layer->window && seen > layer->window ? seen - layer->window : 0;
                const int64_t start = (kv * layer->capacity + first) * head_dim;
                attend_heads(qkv + t * qkv_size + h * head_dim, n, head_dim, layer->keys + start, layer->values + start,
                             mask ? mask + t * total : NULL, attended + (t * heads + h) * head_dim, seen - first,
                             head_dim, scaling, softcap, scores, rows);
            }
            free(scores);
            free(rows);
        }
        project(&layer->o, attended, projected, tokens, q_size, hidden_size);
        add_output(hidden, projected, layer->attention_out_norm, normed, tokens, hidden_size, eps, norm_gains);
        norm_rows(hidden, layer->mlp_norm, normed, tokens, hidden_size, eps, norm_gains);
        project(&layer->gate_up, normed, projected, tokens, hidden_size, 2 * intermediate);
        to_bf16(projected, gate_up, tokens * 2 * intermediate);
        if (activation)
            act_mul_bf16(gate_up, activation, activated, tokens, intermediate);
        else
            silu_mul_bf16(gate_up, activated, tokens, intermediate);
        project(&layer->down, activated, projected, tokens, intermediate, hidden_size);
        add_output(hidden, projected, layer->mlp_out_norm, normed, tokens, hidden_size, eps, norm_gains);
    }
    free(normed); free(qkv); free(attended); free(gate_up); free(activated); free(projected);
}
#endif
