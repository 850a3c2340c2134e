"""A multi-token-prediction (MTP, "nextn") layer a model file carries beside its own layers, in the layout of
DeepSeek-V3's MTP module as vLLM runs it (`DeepSeekMultiTokenPredictorLayer`; GLM-4.5's checkpoints name theirs
the same way, and llama.cpp's converter maps them to `blk.N.nextn.*`), with a dense Llama / Qwen decoder
layer as its block (read by `models.mtp_loading`).

Input at position t: the target's final (normed) hidden state h_t `[H]` and the token x_{t+1} that followed,
embedded with the target's embeddings (or the layer's own `embed_tokens` where the checkpoint carries a copy):

    x = eh_proj(cat[enorm(e(x_{t+1})), hnorm(h_t)])        # [2H] -> [H]; the embedding is zeroed at position 0
    r = x + o_proj(attention(input_layernorm(x)))
    o = r + mlp(post_attention_layernorm(r))

`shared_head.norm(o)` under the head scores the next-next token x_{t+2}: the target's own LM head, or the layer's
`shared_head.head` where the checkpoint carries one (DeepSeek-V3 stores a copy). Drafting the token after feeds o
(before the norm, as vLLM returns it) back in h's place with the token just drafted. The layer keeps its own
position-indexed KV cache (`layer_cache`). The interface is the one `drafters.layer_head` drives (as
`eagle3.Eagle3Model`'s): `project` (the identity here: the target's states are already the layer's input),
`embed`, `forward`, `fed_back`, `draft_logits` and the cache calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specdraft.models.draft_head import SubsetHead
from specdraft.models.eagle3 import attention_and_mlp, rotary_frequencies
from specdraft.models.layer_cache import LayerKVCache, OwnsLayerCache


@dataclass(frozen=True)
class MtpConfig:
    """Shape and options of an MTP layer: the target's layer shape (its config.json) and what the tensors add."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-6
    layer_index: int = 0  # where the checkpoint keeps it: model.layers.{layer_index} (= num_hidden_layers)
    qkv_bias: bool = False  # biases on q/k/v (a Qwen2 layer; Llama's `attention_bias`)
    o_bias: bool = False  # a bias on o (Llama's `attention_bias`)
    qk_norm: bool = False  # q_norm / k_norm (a Qwen3 layer)
    own_embeddings: bool = False  # the checkpoint carries the layer's `embed_tokens` (else the target's)
    own_head: bool = False  # the checkpoint carries `shared_head.head` (else the target's LM head)
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0},
                                  compare=False, hash=False)  # transformers' `rope_parameters`
    rope_factors: tuple[float, ...] | None = None  # read by `eagle3.rotary_frequencies`; none in a folder
    source: str = ""  # where it was read from


class MtpModel(OwnsLayerCache, nn.Module):
    """One MTP layer: `enorm`, `hnorm`, `eh_proj`, a decoder layer with a KV cache, `shared_head_norm`, and the head
    (`lm_head`, a full-vocabulary `SubsetHead`: set by the loader, own or the target's). See the module doc."""

    def __init__(self, config: MtpConfig) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm  # imported with a model, not this module

        super().__init__()
        self.config = config
        width, d, eps = config.hidden_size, config.head_dim, config.rms_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, width) if config.own_embeddings else None
        self.enorm = LlamaRMSNorm(width, eps=eps)
        self.hnorm = LlamaRMSNorm(width, eps=eps)
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        self.input_layernorm = LlamaRMSNorm(width, eps=eps)
        self.q_proj = nn.Linear(width, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(width, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(width, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, width, bias=config.o_bias)
        self.q_norm = LlamaRMSNorm(d, eps=eps) if config.qk_norm else None
        self.k_norm = LlamaRMSNorm(d, eps=eps) if config.qk_norm else None
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=eps)
        self.gate_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, width, bias=False)
        self.shared_head_norm = LlamaRMSNorm(width, eps=eps)
        self.lm_head: SubsetHead | None = None  # the loader sets it (`attach_head`)
        with torch.device("cpu"):  # real values even when built on the meta device (the loader's)
            inv_freq, self.attention_scaling = rotary_frequencies(config)
        self._inv_freq = inv_freq  # [d/2] float32, kept out of `.to(dtype)`
        self.cache = LayerKVCache(config.num_kv_heads, d)

    def attach_head(self, head: SubsetHead) -> None:
        """Score with `head` (over the whole vocabulary: `ids` = 0 .. V - 1)."""
        self.lm_head = head

    # ----- running it ----------------------------------------------------------------------
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The layer reads the target's final states as they are. # [T, H] -> [T, H]"""
        return features

    def embed(self, tokens: torch.Tensor, target_embedding: nn.Module) -> torch.Tensor:
        """Token embeddings `[..., H]`: the layer's own where it has them, else the target's."""
        table = self.embed_tokens if self.embed_tokens is not None else target_embedding
        return table(tokens)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H] previous states: the target's h_t, or fed-back outputs
        embeds: torch.Tensor,  # [T, H] embeddings of the tokens x_{t+1}
        positions: torch.Tensor,  # [T] rotary positions (t)
        visible: torch.Tensor | None = None,  # [T, S] bool over the last S keys, S >= T (tree); None = causal
        use_cache: bool = True,
    ) -> torch.Tensor:
        """The layer's outputs o `[T, H]` (before `shared_head_norm`)."""
        config, length = self.config, hidden.shape[0]
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # vLLM: position 0's input is not used
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # [T, H]
        normed = self.input_layernorm(x)
        q = self.q_proj(normed).view(length, config.num_heads, -1)  # [T, heads, d]
        k = self.k_proj(normed).view(length, config.num_kv_heads, -1)  # [T, kv, d]
        v = self.v_proj(normed).view(length, config.num_kv_heads, -1).transpose(0, 1)  # [kv, T, d]
        return attention_and_mlp(self, q, k, v, x, positions, use_cache, visible)

    def fed_back(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft position reads in h's place: the output itself. # [T, H]"""
        return out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary `[T, V]` of the outputs `[T, H]`."""
        return self.lm_head(self.shared_head_norm(out))
