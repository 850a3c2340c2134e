"""A KV cache in preallocated memory: one slot per position, written in place.

`StaticCache` holds every layer's keys and values in two tensors `[layers, kv_heads, slots, head_dim]`, zeroed
once. A pass writes its tokens' states into the slots it names; how many leading slots are valid is a number
the owner keeps, so rolling back is moving that number and a tree's accepted path is gathered in place
(`keep`). Past the `capacity` usable slots lie `SCRATCH_SLOTS` that never become valid: the padding rows of a
pass run at a bucketed width write there. Every slot always holds finite numbers (zeros or an old pass's
states), so a masked-out key can never turn an attention row into NaN.
"""

from __future__ import annotations

import torch

SCRATCH_SLOTS = 64  # slots past the usable ones, for padding rows (at least the widest bucketed pass)
GROWTH_STEP = 256  # capacities are multiples of this


class StaticCache:
    """Keys and values of every layer, `[layers, kv_heads, capacity + SCRATCH_SLOTS, head_dim]`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        capacity = -(-max(capacity, 1) // GROWTH_STEP) * GROWTH_STEP
        shape = (layers, kv_heads, capacity + SCRATCH_SLOTS, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, kv_heads, S, d]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, kv_heads, S, d]

    @property
    def capacity(self) -> int:
        """How many positions the cache can hold (the scratch slots not counted)."""
        return self.keys.shape[2] - SCRATCH_SLOTS

    @property
    def slots(self) -> int:
        """Every slot, scratch included: the key length an attention pass sees."""
        return self.keys.shape[2]

    @property
    def scratch(self) -> int:
        """The first scratch slot."""
        return self.capacity

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a pass's states: `keys`/`values` `[T, kv_heads, d]` go to `slots` `[T]` of `layer`."""
        self.keys[layer].index_copy_(1, slots, keys.transpose(0, 1))
        self.values[layer].index_copy_(1, slots, values.transpose(0, 1))

    def grow(self, needed: int, length: int) -> None:
        """Make room for `needed` positions (at least doubling), keeping the first `length`. The tensors are
        new afterwards: whatever captured the old ones must be rebuilt."""
        if needed <= self.capacity:
            return
        capacity = -(-max(needed, 2 * self.capacity) // GROWTH_STEP) * GROWTH_STEP
        layers, kv_heads, _, head_dim = self.keys.shape
        grown = StaticCache(layers, kv_heads, head_dim, capacity, self.keys.dtype, self.keys.device)
        grown.keys[:, :, :length] = self.keys[:, :, :length]
        grown.values[:, :, :length] = self.values[:, :, :length]
        self.keys, self.values = grown.keys, grown.values

    def keep(self, start: int, rows: list[int]) -> None:
        """Move the states at slots `start + r` (r in `rows`, increasing) to `start, start + 1, ..`: the
        accepted path of a tree pass that wrote from `start`."""
        if rows == list(range(len(rows))):
            return
        source = torch.tensor(rows, device=self.keys.device) + start  # [n]
        for states in (self.keys, self.values):
            states[:, :, start : start + len(rows)] = states.index_select(2, source)
