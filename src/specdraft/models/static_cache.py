"""A KV cache in preallocated memory: one slot per position, written in place.

`StaticCache` holds every layer's keys and values in one tensor `[layers, slots, 2, kv_heads, head_dim]`, zeroed
once: a slot holds a token's keys then its values, as a joined q/k/v projection lays them out after the
queries, so a pass stores both with one copy. A pass writes its tokens' states into the slots it names; how many leading slots are valid is a number
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
    """Keys and values of every layer, `[layers, capacity + SCRATCH_SLOTS, 2, kv_heads, head_dim]`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        capacity = -(-max(capacity, 1) // GROWTH_STEP) * GROWTH_STEP
        shape = (layers, capacity + SCRATCH_SLOTS, 2, kv_heads, head_dim)
        self.states = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, 2, kv_heads, d]

    @property
    def capacity(self) -> int:
        """How many positions the cache can hold (the scratch slots not counted)."""
        return self.states.shape[1] - SCRATCH_SLOTS

    @property
    def slots(self) -> int:
        """Every slot, scratch included."""
        return self.states.shape[1]

    @property
    def scratch(self) -> int:
        """The first scratch slot."""
        return self.capacity

    def write(self, layer: int, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Store a pass's keys and values, `states` `[T, 2, kv_heads, d]`, at `slots` `[T]` of `layer`."""
        self.states[layer].index_copy_(0, slots, states)

    def keys(self, layer: int, length: int) -> torch.Tensor:
        """The keys of `layer`'s first `length` slots, `[kv_heads, length, d]` (a view)."""
        return self.states[layer, :length, 0].transpose(0, 1)

    def values(self, layer: int, length: int) -> torch.Tensor:
        """The values of `layer`'s first `length` slots, `[kv_heads, length, d]` (a view)."""
        return self.states[layer, :length, 1].transpose(0, 1)

    def grow(self, needed: int, length: int) -> None:
        """Make room for `needed` positions (at least doubling), keeping the first `length`. The tensors are
        new afterwards: whatever captured the old ones must be rebuilt."""
        if needed <= self.capacity:
            return
        capacity = -(-max(needed, 2 * self.capacity) // GROWTH_STEP) * GROWTH_STEP
        layers, _, _, kv_heads, head_dim = self.states.shape
        grown = StaticCache(layers, kv_heads, head_dim, capacity, self.states.dtype, self.states.device)
        grown.states[:, :length] = self.states[:, :length]
        self.states = grown.states

    def keep(self, start: int, rows: list[int]) -> None:
        """Move the states at slots `start + r` (r in `rows`, increasing) to `start, start + 1, ..`: the
        accepted path of a tree pass that wrote from `start`."""
        if rows == list(range(len(rows))):
            return
        source = torch.tensor(rows, device=self.states.device) + start  # [n]
        self.states[:, start : start + len(rows)] = self.states.index_select(1, source)
