"""The model a packed GGUF file runs as, where every layer stacks: our own module tree, not transformers' class.

`gguf_native` fills transformers' own class of the family where a layer cannot stack (a projection unpacked, a
rotary that turns part of each head or changes with the pass, LongRoPE), so `fast_layers` swaps only what it can.
Where every layer stacks (`fits`), nothing of transformers' model remains in use but its config, and importing its
modeling code took most of a later load (3.8-4.9 of 5.5-9.2 s on 2 cores: `transformers.modeling_utils` pulls in
torch's compiler, distributed tensors and SciPy). `PackedForCausalLM` holds the same parts under the same names
(`model.embed_tokens`, `model.layers[i].self_attn` / `.mlp` and the layer shape's norms, `model.norm`,
`model.rotary_emb`, `lm_head`) and computes what transformers' model computes with them, operation for operation:

- the config is the file's, read from the kept `config.json` into a plain `PretrainedConfig`
  (`loading._gguf_config_and_tokenizer`), which names the family in `model_type`;
- norms are `RMSNorm` in the family's formula (`Architecture.rms_norm`), before `fast_layers` makes them native;
- rotary tables come from the config's rotary parameters (one table, or one per layer type: Gemma 3) and the file's
  frequency factors (Llama 3.1+'s `rope_freqs`), computed as transformers' rotary modules compute them;
- masks: causal, limited to a layer's sliding window where it has one (`kv > q - window`, as transformers'), or the
  additive mask a tree pass gives (`CausalLM._attention_mask`);
- a pass returns the logits of its last `logits_to_keep` tokens and, asked for, every layer's input states and the
  final normed states, as transformers' `hidden_states`.

Passes of a few tokens still run on the fused C stack (`fused_decoder`), which reads these modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from specdraft.models.architectures import LAYER_NORMS, head_dim_of
from specdraft.models.attention import GROUPED_SDPA, grouped_sdpa_forward

STATIC_ROPE_TYPES = ("default", "llama3", "linear", "yarn")  # rotary tables that do not change with the pass
QKV, GATE_UP = "self_attn.qkv", "mlp.gate_up"  # where a stacked layer's stacked projections are, inside the layer


class RMSNorm(nn.Module):
    """A family's RMSNorm: Llama's `w ⊙ bf16(x / rms(x))`, or Gemma's `bf16(x / rms(x) · (1 + w))` in float32 (`gain`)
    — transformers' formulas and operations."""

    def __init__(self, weight: torch.Tensor, eps: float, kind: str) -> None:  # weight: [dim]
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon, self.kind = eps, kind

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.kind == "gemma":
            x = hidden_states.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (x * (1.0 + self.weight.float())).type_as(hidden_states)
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


def _inverse_frequencies(config, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[head_dim / 2]` float32, the scale of cos and sin) for one rotary table."""
    rope = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    if rope["rope_type"] == "default":
        dim = head_dim_of(config)
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None, layer_type=layer_type)


class Rotary(nn.Module):
    """Rotary tables: `forward(x, position_ids [B, T], layer_type=None)` -> (cos, sin) `[B, T, head_dim]` in x's
    dtype, one table for every layer or one per layer type (`per_layer_type`)."""

    def __init__(self, config, per_layer_type: bool, frequency_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kinds = sorted(set(config.layer_types)) if per_layer_type else [None]
        self.scaling: dict[str | None, float] = {}
        for kind in self.kinds:
            inv_freq, self.scaling[kind] = _inverse_frequencies(config, kind)
            if frequency_factors is not None:  # Llama 3.1+'s rope_freqs: each divides its frequency (llama.cpp)
                inv_freq = inv_freq / frequency_factors.to(inv_freq.dtype)
            self.register_buffer(self._buffer(kind), inv_freq, persistent=False)  # [head_dim / 2] float32

    @staticmethod
    def _buffer(kind: str | None) -> str:
        return "inv_freq" if kind is None else f"{kind}_inv_freq"

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        kind = layer_type if layer_type in self.scaling else None
        inv_freq = getattr(self, self._buffer(kind))
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)  # [B, T, d / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, d]
        scaling = self.scaling[kind]
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding attention window, None where it sees the whole sequence: by `layer_types` where the
    config has them (Gemma 3, Qwen2), else the config's `sliding_window` for every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None) or None
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


class DecoderLayer(nn.Module):
    """One decoder layer of a declared shape (`LAYER_NORMS`): pre-norm (Llama) or sandwich (Gemma)."""

    def __init__(self, shape: str, norms: dict[str, nn.Module], self_attn: nn.Module, mlp: nn.Module,
                 layer_type: str | None) -> None:
        super().__init__()
        self.norm_names = LAYER_NORMS[shape]
        for name in filter(None, self.norm_names):
            setattr(self, name, norms[name])
        self.self_attn, self.mlp, self.attention_type = self_attn, mlp, layer_type

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values=None) -> torch.Tensor:  # [B, T, H]
        before_attention, attention_out, before_mlp, mlp_out = self.norm_names
        residual = hidden_states
        hidden_states, _ = self.self_attn(getattr(self, before_attention)(hidden_states), position_embeddings,
                                          attention_mask, past_key_values=past_key_values)
        if attention_out:
            hidden_states = getattr(self, attention_out)(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(getattr(self, before_mlp)(hidden_states))
        if mlp_out:
            hidden_states = getattr(self, mlp_out)(hidden_states)
        return residual + hidden_states


def _visibility(positions: torch.Tensor, keys: int, window: int | None) -> torch.Tensor | None:
    """Which of `keys` keys (at positions 0 .. keys - 1) each query at `positions` `[T]` sees `[1, 1, T, keys]` bool:
    those at or before it, within `window` where given; None where a one-token pass sees them all or a pass over an
    empty cache is causal within its window (the attention then masks causally itself)."""
    length = positions.shape[0]
    if window is None or keys <= window:
        if length == 1 or keys == length:
            return None
    key_positions = torch.arange(keys, device=positions.device)  # [S]
    visible = key_positions[None, :] <= positions[:, None]  # [T, S]
    if window is not None:
        visible &= key_positions[None, :] > positions[:, None] - window
    return visible[None, None]


class Decoder(nn.Module):
    """The embedding, decoder layers and final norm (transformers' `model.model`)."""

    def __init__(self, config, embed_tokens: nn.Module, layers: list[DecoderLayer], norm: nn.Module,
                 rotary_emb: Rotary) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = embed_tokens, nn.ModuleList(layers), norm, rotary_emb

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache=None, output_hidden_states: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Final normed states `[B, T, H]`, and with `output_hidden_states` each layer's input states and those."""
        hidden = self.embed_tokens(input_ids)  # [B, T, H]
        keys = (cache.get_seq_length() if cache is not None else 0) + input_ids.shape[1]
        rotary, masks = {}, {}
        states = [] if output_hidden_states else None
        for layer in self.layers:
            kind, window = layer.attention_type, layer.self_attn.sliding_window
            if kind not in rotary:
                rotary[kind] = self.rotary_emb(hidden, position_ids, kind)
            if window not in masks:
                masks[window] = attention_mask if attention_mask is not None else _visibility(position_ids[0], keys,
                                                                                               window)
            if states is not None:
                states.append(hidden)
            hidden = layer(hidden, rotary[kind], masks[window], past_key_values=cache)
        hidden = self.norm(hidden)
        if states is not None:
            states.append(hidden)
        return hidden, None if states is None else tuple(states)


@dataclass
class PassOutput:
    """What a pass returns: logits `[B, T', V]`, the hidden states asked for, the cache."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    past_key_values: object = None


class PackedForCausalLM(nn.Module):
    """A packed GGUF model whose every layer stacks (see the module's text): `model` (a `Decoder`) and `lm_head`."""

    def __init__(self, config, model: Decoder, lm_head: nn.Module) -> None:
        super().__init__()
        self.config, self.model, self.lm_head = config, model, lm_head
        self.generation_config = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its hidden states (the embedding's output)."""
        return self.model.embed_tokens.out_dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = True,
                logits_to_keep: int = 0, output_hidden_states: bool = False, **kwargs) -> PassOutput:
        """Logits of `input_ids` `[B, T]` at `position_ids` `[B, T]` (default: after the cache), appended to
        `past_key_values`; `attention_mask`: None (causal) or additive `[B, 1, T, S]`. Other transformers arguments
        (padding masks, `inputs_embeds`, ...) are refused."""
        if kwargs:
            raise TypeError(f"A packed model's pass takes no {', '.join(sorted(kwargs))}.")
        if attention_mask is not None and attention_mask.dim() != 4:
            raise ValueError("A packed model's pass takes an additive mask [B, 1, T, S] or none.")
        cache = past_key_values if use_cache else None
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        hidden, states = self.model(input_ids, position_ids, attention_mask, cache, output_hidden_states)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden  # [B, T', H]
        logits = self.lm_head(kept)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:  # Gemma 2: transformers' operations
            logits = torch.tanh(logits / cap) * cap
        return PassOutput(logits, states, cache)


def attention_parts(config, layer: int, window: int | None, o_proj: nn.Module, q_norm: nn.Module | None,
                    k_norm: nn.Module | None):
    """What `fast_layers.StackedAttention` reads of a layer's attention, for layer `layer` of `config` (its sliding
    `window` from `layer_windows`)."""
    head_dim = head_dim_of(config)
    scalar = getattr(config, "query_pre_attn_scalar", None)  # Gemma: scores scaled by it, not by the head's width
    return SimpleNamespace(
        config=config, layer_idx=layer, head_dim=head_dim, o_proj=o_proj, q_norm=q_norm, k_norm=k_norm,
        num_key_value_groups=config.num_attention_heads // config.num_key_value_heads,
        scaling=(scalar if scalar is not None else head_dim) ** -0.5, attention_dropout=0.0, is_causal=True,
        sliding_window=window, attend=grouped_sdpa_forward)


def use_own_attention(config) -> None:
    """Mark `config` as running our grouped attention (`attention.GROUPED_SDPA`), as a transformers model switched to
    it says."""
    config._attn_implementation = GROUPED_SDPA
