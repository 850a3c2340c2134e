/* How few-query attention is cut into OpenMP work items (`avx2/attention.h`, `avx512/attention.h`, the decoder stack
 * of `shared/decoder_layers.h`): an item is one query token and up to GROUP_HEADS query heads that read the same key/value
 * head (the including attention file defines GROUP_HEADS: how many heads its `attend_heads` takes at once). A
 * key/value head's `groups` query heads are split into chunks as even as can be: 6 = 3 + 3, 7 = 4 + 3 for 4.
 */
#ifndef SPECDRAFT_ATTENTION_ITEMS_H
#define SPECDRAFT_ATTENTION_ITEMS_H
#pragma once

#include <stdint.h>

typedef struct {
    int64_t groups;  /* query heads per key/value head */
    int64_t count;   /* chunks of them */
    int64_t size;    /* query heads of a chunk (the last may hold fewer) */
} HeadChunks;

static inline HeadChunks head_chunks(int64_t groups) {
    const int64_t count = (groups + GROUP_HEADS - 1) / GROUP_HEADS;
    return (HeadChunks){groups, count, (groups + count - 1) / count};
}

/* Items of a pass over `tokens` query tokens and `kv_heads` key/value heads. */
static inline int64_t work_items(HeadChunks chunks, int64_t kv_heads, int64_t tokens) {
    return kv_heads * chunks.count * tokens;
}

/* Work item `item` (token fastest, then chunk, then key/value head): its query token *t, key/value head *kv and first
 * query head *h; returns how many query heads it takes. */
static inline int work_item(HeadChunks chunks, int64_t tokens, int64_t item, int64_t *t, int64_t *kv, int64_t *h) {
    const int64_t part = item / tokens, first = (part % chunks.count) * chunks.size;
    *t = item % tokens;
    *kv = part / chunks.count;
    *h = *kv * chunks.groups + first;
    return (int)(chunks.groups - first < chunks.size ? chunks.groups - first : chunks.size);
}
#endif
