"""The DFlash block draft (z-lab's `DFlashDraftModel`, "Block Diffusion for Flash Speculative Decoding"): one pass
proposes a whole block of tokens from the target's states (read by `models.dflash_loading`).

Context: the target's states after the layers `target_layer_ids` names (transformers' `hidden_states[i + 1]`), side
by side `[n, len(ids) * H]`, fused once: c = hidden_norm(fc(features)) `[n, H]`. Every draft layer projects c with
its own k_proj / v_proj (k_norm on the keys) into keys and values that stay in its cache: the context is read once.

Block: the last committed token (the anchor) at position N followed by `block_size - 1` mask tokens
(`mask_token_id`) at N + 1 ..., embedded with the target's embeddings. Each of the `num_hidden_layers` Qwen3-type
layers runs the block's rows as queries over [context ; block] keys without a causal mask (the block's rows see
each other), then the MLP; `norm` of the block's outputs under the target's LM head gives row i's logits for the
token at N + i (row 0, the anchor's, is not used). The rows do not depend on the tokens drawn from them: each draft
token is drawn from its own row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from specdraft.models.eagle3 import rotary_frequencies, rotate
from specdraft.models.layer_cache import LayerKVCache


@dataclass(frozen=True)
class DFlashConfig:
    """Shape and options of a DFlash draft (its config.json, named here once)."""

    hidden_size: int  # the draft's width = the target's (it reads the target's embeddings and head)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    block_size: int  # anchor + mask tokens in one pass
    mask_token_id: int
    target_layers: tuple[int, ...]  # transformers' hidden_states indices (`target_layer_ids` + 1)
    rms_eps: float = 1e-6
    attention_bias: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0},
                                  compare=False, hash=False)
    rope_factors: tuple[float, ...] | None = None  # read by `eagle3.rotary_frequencies`; none in a folder
    source: str = ""


class DFlashLayer(nn.Module):
    """One draft layer: a Qwen3 decoder layer whose attention reads the context's keys and values too."""

    def __init__(self, config: DFlashConfig) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm  # imported with a model, not this module

        super().__init__()
        width, d, eps, bias = config.hidden_size, config.head_dim, config.rms_eps, config.attention_bias
        self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
        self.input_layernorm = LlamaRMSNorm(width, eps=eps)
        self.q_proj = nn.Linear(width, config.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(width, config.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(width, config.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * d, width, bias=bias)
        self.q_norm = LlamaRMSNorm(d, eps=eps)
        self.k_norm = LlamaRMSNorm(d, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=eps)
        self.gate_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, width, bias=False)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values `[kv, T, d]` of rows x `[T, H]` (cos, sin: `[T, d]`)."""
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.kv_heads, -1)).transpose(0, 1)  # [kv, T, d]
        v = self.v_proj(x).view(x.shape[0], self.kv_heads, -1).transpose(0, 1)  # [kv, T, d]
        return rotate(k, cos, sin), v

    def forward(self, block: torch.Tensor, context: torch.Tensor, cache: LayerKVCache,
                rotary: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The block's rows after this layer `[B, H]`. block: [B, H]; context: [n, H] (new context rows, whose keys
        and values join `cache`); rotary: cos and sin of the context's and of the block's positions."""
        context_cos, context_sin, block_cos, block_sin = rotary
        keys, values = cache.append(*self.keys_values(context, context_cos, context_sin))  # [kv, S, d]
        normed = self.input_layernorm(block)
        q = self.q_norm(self.q_proj(normed).view(block.shape[0], self.heads, -1)).transpose(0, 1)  # [heads, B, d]
        block_keys, block_values = self.keys_values(normed, block_cos, block_sin)  # [kv, B, d]
        keys, values = torch.cat([keys, block_keys], dim=1), torch.cat([values, block_values], dim=1)
        attended = F.scaled_dot_product_attention(rotate(q, block_cos, block_sin), keys, values,
                                                  enable_gqa=True)  # [heads, B, d]: no mask
        r = block + self.o_proj(attended.transpose(0, 1).reshape(block.shape[0], -1))  # [B, H]
        gated = self.post_attention_layernorm(r)
        return r + self.down_proj(F.silu(self.gate_proj(gated)) * self.up_proj(gated))


class DFlashModel(nn.Module):
    """A DFlash draft: `fc` and `hidden_norm` over the target's features, the layers, `norm` (see the module doc).
    Each layer's cache holds the context's keys and values, never the block's."""

    def __init__(self, config: DFlashConfig) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm  # imported with a model, not this module

        super().__init__()
        self.config = config
        width, eps = config.hidden_size, config.rms_eps
        self.fc = nn.Linear(len(config.target_layers) * width, width, bias=False)
        self.hidden_norm = LlamaRMSNorm(width, eps=eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_layers)])
        self.norm = LlamaRMSNorm(width, eps=eps)
        with torch.device("cpu"):  # real values even when built on the meta device (the loader's)
            inv_freq, self.attention_scaling = rotary_frequencies(config)
        self._inv_freq = inv_freq  # [d/2] float32
        self.caches = [LayerKVCache(config.num_kv_heads, config.head_dim) for _ in range(config.num_layers)]

    def with_own_cache(self) -> "DFlashModel":
        """These weights (shared, not copied) with empty caches of their own: one per sequence drafting."""
        twin = copy.copy(self)
        twin.caches = [cache.fresh() for cache in self.caches]
        return twin

    @property
    def cache_len(self) -> int:
        return self.caches[0].length if self.caches else 0

    def reset_cache(self, capacity: int = 0) -> None:
        for cache in self.caches:
            cache.reset(capacity)

    def truncate(self, length: int) -> None:
        for cache in self.caches:
            cache.truncate(length)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, d]` of `positions` `[T]`."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * self._inv_freq  # [T, d/2]
        angles = torch.cat([angles, angles], dim=-1)  # [T, d]
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)

    def forward(
        self,
        features: torch.Tensor,  # [n, len(target_layers) * H] the target's states at positions the cache lacks
        embeds: torch.Tensor,  # [B, H] the block's embeddings: anchor, then mask tokens
        start: int,  # position of the first new context row (the caches' length)
        anchor: int,  # position of the anchor (start + n)
    ) -> torch.Tensor:
        """The block's outputs after `norm` `[B, H]` (row i: the token at anchor + i); the new context joins the
        caches."""
        context = self.hidden_norm(self.fc(features))  # [n, H]
        device = embeds.device
        rotary = (*self._rotary(torch.arange(start, start + context.shape[0], device=device), embeds.dtype),
                  *self._rotary(torch.arange(anchor, anchor + embeds.shape[0], device=device), embeds.dtype))
        hidden = embeds
        for layer, cache in zip(self.layers, self.caches):
            hidden = layer(hidden, context, cache, rotary)
        return self.norm(hidden)
