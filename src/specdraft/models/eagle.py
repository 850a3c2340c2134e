"""The EAGLE feature drafter (Li et al. 2024): one small decoder layer that extrapolates the
target's final hidden states.

Input at position t: the target's feature f_t (its final hidden state there) and the
embedding of the token x_{t+1} that followed (the target's own embedding table, frozen):
`fc([f_t ; e(x_{t+1})])` goes through one decoder layer (RMSNorm, rotary grouped-query
attention, SwiGLU) of width `width`, and `out(norm(.))` predicts f_{t+1}, whose logits
under the target's LM head (restricted to the drafter's vocabulary) give x_{t+2}. Drafting
feeds each predicted feature back in with the token chosen from it.

The layer keeps its own preallocated KV cache (position-indexed: cutting back moves a
length, rejected slots are overwritten). Training runs the same layer over whole sequences
without the cache.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE drafter."""

    hidden_size: int  # the target's
    width: int = 768
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 2048
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def to_json(self) -> str:
        return json.dumps({"kind": "eagle", **asdict(self)})


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (half-split pairs, as in Llama/Qwen). x: [heads, T, d]; positions: [T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [d/2]
    angles = positions.float().unsqueeze(-1) * freqs  # [T, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class EagleDrafterModel(nn.Module):
    """fc over [feature ; token embedding], one decoder layer, and a projection back to the target's feature space."""

    def __init__(self, config: EagleConfig) -> None:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # imported with a model, not this module

        super().__init__()
        self.config = config
        hidden, width, d = config.hidden_size, config.width, config.head_dim
        self.fc = nn.Linear(2 * hidden, width, bias=False)
        self.attn_norm = Qwen2RMSNorm(width, eps=config.rms_eps)
        self.q_proj = nn.Linear(width, config.num_heads * d, bias=True)
        self.k_proj = nn.Linear(width, config.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(width, config.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(config.num_heads * d, width, bias=False)
        self.mlp_norm = Qwen2RMSNorm(width, eps=config.rms_eps)
        self.gate_up = nn.Linear(width, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, width, bias=False)
        self.out_norm = Qwen2RMSNorm(width, eps=config.rms_eps)
        self.out = nn.Linear(width, hidden, bias=False)
        self.reset_cache(0)

    # ----- the cache ---------------------------------------------------------------------
    def with_own_cache(self) -> "EagleDrafterModel":
        """These weights (shared, not copied) with an empty cache of their own: one per sequence drafting."""
        twin = copy.copy(self)
        twin.reset_cache(0)
        return twin

    def reset_cache(self, capacity: int) -> None:
        """An empty cache of `capacity` positions (grown on demand)."""
        self._keys = self._values = None
        self.cache_len = 0
        self._capacity = capacity

    def _ensure(self, length: int, like: torch.Tensor) -> None:
        if self._keys is not None and self._keys.shape[1] >= length:
            return
        capacity = max(length, 2 * (self._keys.shape[1] if self._keys is not None else 256))
        shape = (self.config.num_kv_heads, capacity, self.config.head_dim)
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self._keys is not None:
            keys[:, : self.cache_len] = self._keys[:, : self.cache_len]
            values[:, : self.cache_len] = self._values[:, : self.cache_len]
        self._keys, self._values = keys, values

    def truncate(self, length: int) -> None:
        """Forget every cached position from `length` on."""
        self.cache_len = min(self.cache_len, length)

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep positions `< start` and, after them, the ones fed at `start + r` for r in `rows`."""
        if rows != list(range(len(rows))):
            source = torch.tensor(rows, device=self._keys.device) + start
            self._keys[:, start:start + len(rows)] = self._keys[:, source]
            self._values[:, start:start + len(rows)] = self._values[:, source]
        self.truncate(start + len(rows))

    # ----- running it ----------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,  # [T, H] the target's (or predicted) features f_t
        embeds: torch.Tensor,  # [T, H] embeddings of the tokens x_{t+1}
        positions: torch.Tensor,  # [T] rotary positions
        visible: torch.Tensor | None = None,  # [T, S] bool over the last S keys, S >= T (tree); None = causal
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Predicted next features `[T, H]`. With `use_cache` the new keys are appended to the cache
        and the queries see it whole; without, the T positions form the whole (causal) sequence."""
        config = self.config
        x = self.fc(torch.cat([features, embeds], dim=-1))  # [T, W]
        length = x.shape[0]
        h = self.attn_norm(x)
        q = self.q_proj(h).view(length, config.num_heads, -1).transpose(0, 1)  # [heads, T, d]
        k = self.k_proj(h).view(length, config.num_kv_heads, -1).transpose(0, 1)  # [kv, T, d]
        v = self.v_proj(h).view(length, config.num_kv_heads, -1).transpose(0, 1)
        q, k = rotate(q, positions, config.rope_theta), rotate(k, positions, config.rope_theta)
        if use_cache:
            start = self.cache_len
            self._ensure(start + length, k)
            self._keys[:, start:start + length] = k
            self._values[:, start:start + length] = v
            k, v = self._keys[:, : start + length], self._values[:, : start + length]
            self.cache_len = start + length
            allowed = torch.ones(length, start + length, dtype=torch.bool, device=x.device)  # [T, cache + T]
            if visible is None:
                visible = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            allowed[:, start + length - visible.shape[1]:] = visible
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)  # [heads, T, d]
        else:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attended.transpose(0, 1).reshape(length, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self.out(self.out_norm(x))  # [T, H]
