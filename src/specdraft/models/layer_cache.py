"""The KV cache of a one-layer drafter (EAGLE-3, MTP): preallocated, position-indexed, cut back by moving a length.

Rows `[0, length)` hold the keys and values of the pairs fed so far; a pass appends its rows after them and
attends to the whole. Cutting back (`truncate`) moves the length, and rejected rows are simply overwritten by the
next pass (gpt-fast's habit); `keep` gathers a tree pass's accepted rows in place.
"""

from __future__ import annotations

import copy
from typing import Self

import torch
from torch.nn import functional as F


class LayerKVCache:
    """Keys and values `[kv_heads, capacity, head_dim]` of one attention layer, grown on demand."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 0) -> None:
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.keys: torch.Tensor | None = None  # [kv, capacity, d]
        self.values: torch.Tensor | None = None  # [kv, capacity, d]
        self.length = 0
        self._capacity = capacity

    def fresh(self) -> "LayerKVCache":
        """An empty cache of the same shape (one per sequence drafting)."""
        return LayerKVCache(self.kv_heads, self.head_dim, self._capacity)

    def reset(self, capacity: int = 0) -> None:
        """Forget every row; the next pass allocates room for `capacity` positions at least."""
        self.keys = self.values = None
        self.length, self._capacity = 0, capacity

    def truncate(self, length: int) -> None:
        """Forget every row from `length` on."""
        self.length = min(self.length, length)

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep rows `< start` and, after them, the rows fed at `start + r` for r in `rows` (increasing).

        Example: start 10, rows [0, 2] after a pass that fed 10..13 -> rows 0..9, then those fed at 10 and 12.
        """
        if self.keys is not None and rows != list(range(len(rows))):
            source = torch.tensor(rows, device=self.keys.device) + start  # [n]
            self.keys[:, start:start + len(rows)] = self.keys[:, source]
            self.values[:, start:start + len(rows)] = self.values[:, source]
        self.truncate(start + len(rows))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's rows (keys, values: `[kv, T, d]`) after the cached ones; returns every row's keys and
        values `[kv, length + T, d]` (views) and moves the length past them."""
        start, count = self.length, keys.shape[1]
        self._ensure(start + count, keys)
        self.keys[:, start:start + count] = keys
        self.values[:, start:start + count] = values
        self.length = start + count
        return self.keys[:, :self.length], self.values[:, :self.length]

    def _ensure(self, length: int, like: torch.Tensor) -> None:
        """Room for `length` rows, of `like`'s dtype and device, keeping the cached ones."""
        held = 0 if self.keys is None else self.keys.shape[1]
        if self.keys is not None and held >= length and self.keys.dtype == like.dtype:
            return
        capacity = max(length, self._capacity, 2 * held, 256)
        shape = (self.kv_heads, capacity, self.head_dim)
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self.keys is not None:
            keys[:, :self.length] = self.keys[:, :self.length]
            values[:, :self.length] = self.values[:, :self.length]
        self.keys, self.values = keys, values


class OwnsLayerCache:
    """The cache methods of a one-layer drafter's module (`eagle3.Eagle3Model`, `mtp.MtpModel`) that keeps its
    layer's `LayerKVCache` in `self.cache`."""

    cache: LayerKVCache

    def with_own_cache(self) -> Self:
        """These weights (shared, not copied) with an empty cache of their own: one per sequence drafting."""
        twin = copy.copy(self)
        twin.cache = self.cache.fresh()
        return twin

    @property
    def cache_len(self) -> int:
        return self.cache.length

    def reset_cache(self, capacity: int = 0) -> None:
        self.cache.reset(capacity)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


def cached_attention(cache: LayerKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a pass's T rows after `cache`'s: their keys and values join the cache, and each query sees every
    cached row and, among the pass's last S rows, those `visible` marks (None: causal). Returns `[heads, T, d]`.

    q: [heads, T, d]; k, v: [kv, T, d] (rotated); visible: [T, S] bool, S >= T (a tree pass: its rows' ancestors).
    """
    length, start = q.shape[1], cache.length
    k, v = cache.append(k, v)  # [kv, start + T, d]
    allowed = torch.ones(length, start + length, dtype=torch.bool, device=q.device)  # [T, start + T]
    if visible is None:
        visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    allowed[:, start + length - visible.shape[1]:] = visible
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
