"""A KV cache layer that appends in place.

transformers' `DynamicLayer` appends a pass's keys and values with `torch.cat`, which copies the
layer's whole cache on every pass: at 1,200 cached tokens of a 1.5B model (28 layers, 2 key/value
heads of 128), 34 MB a decoding step. `GrowingLayer` keeps its states in a buffer with room to
spare and writes each pass into it; `keys` and `values` stay views of the buffer's first tokens,
so cropping (a view) and in-place edits (`CausalLM.keep`) work as before.

Sliding-window layers (Gemma's) are `GrowingLayer`s too, holding every token: transformers' masks hide what lies
past a layer's window (they are made from the config's window and absolute positions, whatever the cache layer),
the fused layers (`fused_decoder`) read the window from the buffer as it is, and a cache cut back keeps the states
the window needs again.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

# Room added when a buffer grows: as many tokens as it then holds, at most SPARE_TOKENS (a copy of the cache every
# 256 tokens, not every pass). A short prompt's cache keeps little spare: the spare's memory counts in the process's
# resident size, as heap memory freed before is reused (a 90-token prompt of a 28-layer model: 29 MB at 256 spare).
SPARE_TOKENS = 256


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` whose appends write into a buffer `[B, heads, capacity, d]` instead of concatenating."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length = self.reserve(key_states, value_states, key_states.shape[-2])
        needed = length + key_states.shape[-2]
        self.key_buffer[..., length:needed, :] = key_states
        self.value_buffer[..., length:needed, :] = value_states
        self.advance(needed)
        return self.keys, self.values

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, tokens: int) -> int:
        """Make room in the buffers for `tokens` more tokens shaped like `key_states`/`value_states`
        `[B, heads, *, d]`; returns how many the layer holds now."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.key_buffer = self.value_buffer = None
        length = self.keys.shape[-2] if self.keys.numel() else 0
        if not self._holds(length, key_states, length + tokens):
            self._grow(length, key_states, value_states, length + tokens)
        return length

    def advance(self, length: int) -> None:
        """Hold the buffers' first `length` tokens (written there in place)."""
        self.keys, self.values = self.key_buffer[..., :length, :], self.value_buffer[..., :length, :]

    def _holds(self, length: int, key_states: torch.Tensor, needed: int) -> bool:
        """Whether the buffer has room and `keys`/`values` are still views of its first tokens."""
        buffer = self.key_buffer
        if buffer is None or needed > buffer.shape[-2] or buffer.shape[:2] != key_states.shape[:2]:
            return False
        return length == 0 or (self.keys.data_ptr() == buffer.data_ptr() and self.keys.stride() == buffer.stride()
                               and self.values.data_ptr() == self.value_buffer.data_ptr())

    def _grow(self, length: int, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        batch, heads, _, _ = key_states.shape
        capacity = needed + min(SPARE_TOKENS, needed)
        self.key_buffer = key_states.new_empty((batch, heads, capacity, key_states.shape[-1]))  # [B, kv_heads, cap, d]
        self.value_buffer = value_states.new_empty((batch, heads, capacity, value_states.shape[-1]))
        if length:
            self.key_buffer[..., :length, :] = self.keys
            self.value_buffer[..., :length, :] = self.values


def growing_cache(config) -> DynamicCache:
    """A `DynamicCache` for `config` whose full- and sliding-attention layers are `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache
