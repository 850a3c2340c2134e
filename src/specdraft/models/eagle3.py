"""The EAGLE-3 draft head (Li et al. 2025) as its published checkpoints define it (SpecForge, vLLM speculators,
llama.cpp's GGUF; read by `models.eagle3_loading`).

Input at position t: the target's states entering `aux_layers` (transformers' `hidden_states[i]`: index 0 the
embeddings, i the output of decoder layer i - 1; three of them, low, middle and high), side by side
`[t, 3 * H_target]`, fused by `fc` into one draft state g_t `[t, H]`; and the token x_{t+1} that followed, embedded
(the head's own `embed_tokens` where the checkpoint has one, else the target's). One decoder layer reads both:

    a = attention(cat[input_layernorm(e(x_{t+1})), hidden_norm(g_t)])      # q/k/v take 2H wide rows
    r = g_t + o_proj(a)            (hidden_norm(g_t) + o_proj(a) where `norm_before_residual`)
    h = r + mlp(post_attention_layernorm(r))

`norm(h)` under `lm_head` scores the draft vocabulary (`draft_vocab_size` tokens; draft id j is target id
j + d2t[j]), held here as a `draft_head.SubsetHead` whose rows are sorted by target id: its full-width logits are
-inf off the draft vocabulary, so q = 0 there. Drafting the next token feeds h back in g's place (no `fc`: h is
already a draft state; `norm(h)` where the speculators config says `norm_output`).

Optional parts the sources add, each read from the checkpoint: `input_norm` (an RMSNorm over the fused features
before `fc`: `norm_before_fc`), `fc_norm` (one RMSNorm per aux layer), `q_norm`/`k_norm` (a Qwen3-type layer),
biases on q/k/v/o (`attention_bias`). The layer keeps its own position-indexed KV cache (`layer_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from specdraft.errors import SpecdraftError
from specdraft.models.draft_head import SubsetHead
from specdraft.models.layer_cache import LayerKVCache, OwnsLayerCache, cached_attention

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-independent frequencies: what a cached layer can use


@dataclass(frozen=True)
class Eagle3Config:
    """Shape and options of an EAGLE-3 head (the published configs' keys, named here once)."""

    hidden_size: int  # the head's width H
    target_hidden_size: int  # the target's: each aux layer's width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    vocab_size: int  # the target's
    rms_eps: float = 1e-6
    num_aux: int = 3  # target layers fused by fc
    aux_layers: tuple[int, ...] | None = None  # transformers' hidden_states indices; None: the sources' default
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    feed_normed: bool = False  # feed norm(h) back when drafting (speculators' `norm_output`)
    logits_normed: bool = True  # lm_head reads norm(h) (SpecForge's `norm_output`, True unless set false)
    attention_bias: bool = False
    qk_norm: bool = False
    own_embeddings: bool = False  # the checkpoint carries `embed_tokens` (else the target's are used)
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0},
                                  compare=False, hash=False)  # transformers' `rope_parameters`
    rope_factors: tuple[float, ...] | None = None  # llama.cpp's rope_freqs (frequencies divided by them)
    source: str = ""  # the format it was read from: specforge, speculators or gguf

    def resolved_aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target's hidden_states indices fed to `fc`, for a target of `target_layers` decoder layers: the
        checkpoint's, else (2, L // 2, L - 3) as SpecForge, vLLM, speculators and llama.cpp all default. Each
        must be a layer's input (0 .. L - 1): the last entry of transformers' tuple is normed, no layer's input."""
        layers = self.aux_layers or (2, target_layers // 2, target_layers - 3)
        if len(layers) != self.num_aux:
            raise SpecdraftError(f"This EAGLE-3 head fuses {self.num_aux} target layers (its fc reads "
                                 f"{self.num_aux} x {self.target_hidden_size}); its config names {len(layers)}: "
                                 f"{list(layers)}. Fix `eagle_aux_hidden_state_layer_ids` in its config.json.")
        if any(not 0 <= i < target_layers for i in layers):
            raise SpecdraftError(f"This EAGLE-3 head reads target layers {list(layers)}, but the target has "
                                 f"{target_layers} (layer inputs 0 .. {target_layers - 1}). Set "
                                 "`eagle_aux_hidden_state_layer_ids` in the head's config.json to the layers it was "
                                 "trained on, or use a head trained for this target.")
        return tuple(int(i) for i in layers)


def rotary_frequencies(config: Eagle3Config) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies `[head_dim / 2]` (float32) and attention scaling of `config`."""
    if config.rope_factors is not None:  # llama.cpp: base frequencies divided by the file's factors
        theta = float(config.rope_parameters.get("rope_theta", 10000.0))
        half = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        return 1.0 / (theta ** half) / torch.tensor(config.rope_factors, dtype=torch.float32), 1.0
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise SpecdraftError(f"This EAGLE-3 head's rotary embedding is {rope_type!r}; the drafter runs "
                             f"{', '.join(ROPE_TYPES)} (frequencies that do not change with the sequence).")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    layout = LlamaConfig(hidden_size=config.num_heads * config.head_dim, num_attention_heads=config.num_heads,
                         head_dim=config.head_dim, rope_parameters=dict(config.rope_parameters),
                         max_position_embeddings=1 << 24)  # the frequencies need no context length; this one no warning
    rotary = LlamaRotaryEmbedding(layout)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in transformers' half-split layout. x: [heads, T, d]; cos, sin: [T, d]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
    return x * cos + turned * sin


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) rotated -> [heads, T, d]


def attention_and_mlp(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor,
                      positions: torch.Tensor, use_cache: bool, visible: torch.Tensor | None,
                      attend: Attend | None = None) -> torch.Tensor:
    """The rest of a one-layer head's decoder layer (EAGLE-3's, MTP's) from its projections q `[T, heads, d]`,
    k `[T, kv, d]`, v `[kv, T, d]`: the optional q/k norms, rotary, attention (over `layer.cache` with `use_cache`,
    else causal over the T rows; `attend` where given: q `[heads, T, d]` and k `[kv, T, d]` rotated, v `[kv, T, d]`,
    to whatever it keeps, as training's unrolled steps do), o, the residual, and the SwiGLU MLP with its own residual
    -> `[T, H]`."""
    length = q.shape[0]
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    if layer._inv_freq.device != positions.device:
        layer._inv_freq = layer._inv_freq.to(positions.device)
    angles = positions.float().unsqueeze(-1) * layer._inv_freq  # [T, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, d]
    cos = (angles.cos() * layer.attention_scaling).to(q.dtype)
    sin = (angles.sin() * layer.attention_scaling).to(q.dtype)
    q, k = rotate(q.transpose(0, 1), cos, sin), rotate(k.transpose(0, 1), cos, sin)  # [heads|kv, T, d]
    if attend is not None:
        attended = attend(q, k, v)  # [heads, T, d]
    elif use_cache:
        attended = cached_attention(layer.cache, q, k, v, visible)  # [heads, T, d]
    else:
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r = residual + layer.o_proj(attended.transpose(0, 1).reshape(length, -1))  # [T, H]
    gated = layer.post_attention_layernorm(r)
    return r + layer.down_proj(F.silu(layer.gate_proj(gated)) * layer.up_proj(gated))



class Eagle3Model(OwnsLayerCache, nn.Module):
    """An EAGLE-3 head: `project` (fc over the target's aux states), one decoder layer over [embedding ; state]
    with a KV cache, and `lm_head` over the draft vocabulary (see the module doc)."""

    def __init__(self, config: Eagle3Config) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm  # imported with a model, not this module

        super().__init__()
        self.config = config
        width, d, fused = config.hidden_size, config.head_dim, config.num_aux * config.target_hidden_size
        eps, bias = config.rms_eps, config.attention_bias
        self.input_norm = LlamaRMSNorm(fused, eps=eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(config.target_hidden_size, eps=eps) for _ in range(config.num_aux)])
                        if config.fc_norm else None)
        self.fc = nn.Linear(fused, width, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, width) if config.own_embeddings else None
        self.input_layernorm = LlamaRMSNorm(width, eps=eps)
        self.hidden_norm = LlamaRMSNorm(width, eps=eps)
        self.q_proj = nn.Linear(2 * width, config.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(2 * width, config.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(2 * width, config.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * d, width, bias=bias)
        self.q_norm = LlamaRMSNorm(d, eps=eps) if config.qk_norm else None
        self.k_norm = LlamaRMSNorm(d, eps=eps) if config.qk_norm else None
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=eps)
        self.gate_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(width, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, width, bias=False)
        self.norm = LlamaRMSNorm(width, eps=eps)
        # rows sorted by target id (the loader sorts them); placeholder ids until it fills them
        self.lm_head = SubsetHead(torch.zeros(config.draft_vocab_size, width),
                                  torch.arange(config.draft_vocab_size), config.vocab_size)
        with torch.device("cpu"):  # real values even when built on the meta device (the loader's)
            inv_freq, self.attention_scaling = rotary_frequencies(config)
        self._inv_freq = inv_freq  # [d/2] float32, kept out of `.to(dtype)`: positions need its precision
        self.cache = LayerKVCache(config.num_kv_heads, d)

    # ----- running it ----------------------------------------------------------------------
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The draft states g `[T, H]` of the target's aux states `features` `[T, num_aux * H_target]`."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def embed(self, tokens: torch.Tensor, target_embedding: nn.Module) -> torch.Tensor:
        """Token embeddings `[..., H]`: the head's own where it has them, else the target's."""
        table = self.embed_tokens if self.embed_tokens is not None else target_embedding
        return table(tokens)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H] draft states: fc of the target's features, or fed-back outputs
        embeds: torch.Tensor,  # [T, H] embeddings of the tokens x_{t+1}
        positions: torch.Tensor,  # [T] rotary positions
        visible: torch.Tensor | None = None,  # [T, S] bool over the last S keys, S >= T (tree); None = causal
        use_cache: bool = True,
        attend: Attend | None = None,  # how the rows attend, in place of the cache or the causal rows (training)
    ) -> torch.Tensor:
        """The layer's outputs h `[T, H]` (before `norm`). With `use_cache` the new keys join the cache and the
        queries see it whole; without, the T rows form the whole (causal) sequence; `attend` decides itself."""
        config, length = self.config, hidden.shape[0]
        normed = self.hidden_norm(hidden)
        residual = normed if config.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        q = self.q_proj(x).view(length, config.num_heads, -1)  # [T, heads, d]
        k = self.k_proj(x).view(length, config.num_kv_heads, -1)  # [T, kv, d]
        v = self.v_proj(x).view(length, config.num_kv_heads, -1).transpose(0, 1)  # [kv, T, d]
        return attention_and_mlp(self, q, k, v, residual, positions, use_cache, visible, attend)

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """What `lm_head` reads of the layer's outputs `[T, H]`."""
        return self.norm(out) if self.config.logits_normed else out

    def fed_back(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft position reads in g's place `[T, H]`."""
        return self.norm(out) if self.config.feed_normed else out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary `[T, V]` (-inf off the draft vocabulary) of the outputs `[T, H]`."""
        return self.lm_head(self.head_input(out))
