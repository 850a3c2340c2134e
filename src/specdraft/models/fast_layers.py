"""Decoder layers of a packed model of a declared layer shape (pre-norm: Llama, Mistral, Qwen2, Qwen3, Phi-3;
sandwich: Gemma 2 and 3; see `models/architectures.py`) with fewer kernel calls and dispatches.

Norms: each RMSNorm of a bf16 model on a CPU with AVX-512 BF16 runs as one C call
(`kernels/layer_ops.c`) instead of seven PyTorch ops (57 norms a step in a 1.5B model), in its family's formula.

Projections:
A decoding step calls the tile kernels once per projection: seven calls a layer, each with its
own conversions and output. Projections that read the same input (q, k and v; gate and up)
are stacked here into one matrix a kernel reads in one call: the tiles of both layouts
(`int4_layout.pack`, `gguf_matmul.pack_q6k`) are blocks of 16 output rows, so stacking is
concatenation, and each output row is computed exactly as before (same code, same order), so
the model's outputs are unchanged bit for bit. Phi-3's files hold q|k|v and gate|up stacked already. Projections of different block types (a Q6_K
`v` among Q4_K `q` and `k`, as Q4_K_M files mix them) run as one call per type.

Measured (1.5B Q4_K_M target, 2 cores, AVX-512): gate and up of 28 layers, 11.35 ms as two
calls, 10.42 ms as one.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from types import SimpleNamespace

import torch
from torch import nn

from specdraft.kernels import decoder_layers, dense_matmul, gguf_matmul, int8_codes, layer_ops, q4k_tiles
from specdraft.kernels.tile_linear import packed_tensors
from specdraft.models.architectures import LAYER_NORMS, Architecture, stacked_architecture
from specdraft.models.heap import drop_file_pages, trim_heap
from specdraft.models.packed_model import RMSNorm
from specdraft.models.quantize import Int4Linear, SplitInt4Linear

FUSED_ATTRIBUTE = "_specdraft_fused_decoder"  # where `fused_decoder.fused_decoder` keeps its verdict on a model


@cache
def transformers_parts() -> SimpleNamespace:
    """What these layers take from transformers' modeling, imported when a model is first loaded (`load_model` times
    it) or swapped, not with this module, so importing specdraft does not import transformers' modeling:

    - `rms_norms`: the families' RMSNorms by formula (`architectures.Architecture.rms_norm`);
    - `tabled_activations`: activations other than SiLU that act on each value alone, whose table of PyTorch's values
      is tested to give its bits (Gemma's `gelu_pytorch_tanh`);
    - `silu`: transformers' SiLU module; the attention functions the PyTorch path calls.

    A model of our own (`packed_model`) needs none of them: its norms, activations and attention are ours."""
    from transformers.activations import GELUTanh, SiLUActivation
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm, eager_attention_forward
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return SimpleNamespace(
        rms_norms={"llama": (LlamaRMSNorm, MistralRMSNorm, Phi3RMSNorm, Qwen2RMSNorm, Qwen3RMSNorm),
                   "gemma": (Gemma2RMSNorm, Gemma3RMSNorm)},
        tabled_activations=(GELUTanh,), silu=SiLUActivation, attention_functions=ALL_ATTENTION_FUNCTIONS,
        eager_attention=eager_attention_forward)


def _from_transformers(module: nn.Module) -> bool:
    """Whether `module` is one of transformers' classes (asking `transformers_parts` about it then imports nothing new)."""
    return type(module).__module__.startswith("transformers.")


def activation_kind(act_fn: nn.Module) -> str | None:
    """`silu` for SiLU, `tabled` for an activation `decoder_layers.activation_table` gives the bits of (the tanh GELU:
    Gemma's `gelu_pytorch_tanh`), None for another."""
    if isinstance(act_fn, nn.SiLU):
        return "silu"
    if isinstance(act_fn, nn.GELU) and act_fn.approximate == "tanh":
        return "tabled"
    if _from_transformers(act_fn):
        parts = transformers_parts()
        if isinstance(act_fn, parts.silu):
            return "silu"
        if isinstance(act_fn, parts.tabled_activations):
            return "tabled"
    return None


def rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # q, k: [B, heads, T, d]; cos, sin: [B, T, d]
    """Rotate q and k by (cos, sin), turning whole heads: transformers' `apply_rotary_pos_emb`, operation for
    operation (`x · cos + rotate_half(x) · sin`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)


# Linears over weights kept as the file stores them, whose `type_name` is their run kind, and those of their kernels
# whose decoder run kind is `decoder_layers.code_kind(type_name)` (the dense ones have one per element type)
STORED_LINEARS = (dense_matmul.DenseLinear, int8_codes.CodeLinear, q4k_tiles.Q4KLinear, q4k_tiles.Q40Linear)
CODE_MATMULS = (int8_codes.code_matmul, q4k_tiles.q4k_matmul, q4k_tiles.q4_0_matmul)


def run_kind(linear: nn.Module) -> str | None:
    """Which stackable kind a projection is (`int4`, `q6k`, `F16`, `BF16`, `F32`, `Q8_0`, `IQ4_NL`, `IQ4_XS`, `Q4_K`,
    `Q4_0`), None when it cannot be stacked. 4-bit
    halves side by side (`SplitInt4Linear`) are `int4` runs whose packed matrix reads each input twice."""
    if isinstance(linear, SplitInt4Linear):
        linear = linear.halves
    if isinstance(linear, Int4Linear) and linear.tiles is not None and linear.dense_weight is None:
        return "int4"
    if isinstance(linear, gguf_matmul.BlockLinear):
        return "q6k"
    if isinstance(linear, STORED_LINEARS):
        return linear.type_name  # F16, BF16, F32, or Q8_0, IQ4_NL, IQ4_XS, Q4_K, Q4_0
    return None


def _run_key(part: nn.Module) -> tuple:
    """What parts must share to be one run: their kind, whether they are split halves, and their code width."""
    packed = getattr(getattr(part, "halves", part), "tiles", None)
    return run_kind(part), isinstance(part, SplitInt4Linear), getattr(packed, "bits", None)


class StackedProjection(nn.Module):
    """Projections of one input stacked by rows: `forward(x [..., K])` -> float32 `[..., ΣN]`, biases added.

    Consecutive parts of the same kind (and the same inputs: x, or [x, x] for split halves) share one kernel call.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.runs: list[tuple[object, object]] = []  # (kernel function, packed matrix)
        start = 0
        while start < len(parts):
            kind = _run_key(parts[start])
            stop = start + 1
            while stop < len(parts) and _run_key(parts[stop]) == kind:
                stop += 1
            self.runs.append(self._stack(kind[0], [getattr(p, "halves", p) for p in parts[start:stop]], len(self.runs)))
            start = stop
        # whether a run holds split 4-bit halves, which read each input twice ([x, x])
        self.reads_twice = any(packed.in_features != self.in_features for _, packed in self.runs)
        biases = [part.bias.float() if part.bias is not None else torch.zeros(part.out_features) for part in parts]
        has_bias = any(part.bias is not None for part in parts)
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if has_bias else None  # [ΣN] float32, the parts' values

    def _stack(self, kind: str, parts: list[nn.Module], index: int) -> tuple[object, object]:
        """One run: the parts' packed matrices (of one kind) stacked row-wise, each tensor concatenated, with the kernel
        that multiplies it; its tensors kept as buffers, so the module's memory shows them."""
        packs = [part.tiles if kind == "int4" else part.packed for part in parts]
        stacked = replace(packs[0], out_features=sum(part.out_features for part in parts),
                          **{name: torch.cat([getattr(p, name) for p in packs]) for name, _ in packed_tensors(packs[0])})
        for name, tensor in packed_tensors(stacked):
            self.register_buffer(f"run{index}_{name}", tensor)
        return (parts[0].tile_matmul if kind == "int4" else parts[0].matmul), stacked

    def num_packed_weights(self) -> int:
        """How many weights the stacked matrices hold."""
        return self.out_features * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> float32 [..., ΣN]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [tokens, K]
        twice = torch.cat([flat, flat], dim=-1) if self.reads_twice else None
        outs = [matmul(packed, flat if packed.in_features == self.in_features else twice)
                for matmul, packed in self.runs]  # [tokens, N_run] each
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [tokens, ΣN]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class StackedMLP(nn.Module):
    """The gated MLP, `down(act(gate x) · up x)`, with gate and up in one kernel call."""

    def __init__(self, gate_up: list[nn.Module] | StackedProjection, down_proj: nn.Module, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up = gate_up if isinstance(gate_up, StackedProjection) else StackedProjection(gate_up)
        self.intermediate = self.gate_up.out_features // 2
        self.down_proj, self.act_fn = down_proj, act_fn
        # SiLU·up as one C call where it gives PyTorch's bits (its own exp): 4 PyTorch passes over a prompt's
        # [T, 2I] in one (1,500 tokens, 28 layers: 0.6 s in PyTorch)
        kind = activation_kind(act_fn)
        self.silu = kind == "silu"
        self.native_silu = self.silu and self.intermediate % 16 == 0 and decoder_layers.same_silu_as_torch()
        # another activation (Gemma's GELU) as one C call too, read from a table of PyTorch's values ([65537] int16)
        tabled = kind == "tabled" and self.intermediate % 16 == 0 and decoder_layers.available()
        self.register_buffer("activation_table", decoder_layers.activation_table(act_fn) if tabled else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., H] bf16
        gate_up = self.gate_up(x).to(x.dtype)  # [..., 2I]: rounded as the separate projections' outputs were
        if gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu":
            if self.native_silu:
                return self.down_proj(decoder_layers.silu_mul(gate_up))
            if self.activation_table is not None:
                return self.down_proj(decoder_layers.act_mul(gate_up, self.activation_table))
        return self.down_proj(self.act_fn(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :])


class StackedAttention(nn.Module):
    """The stacked families' attention (the steps of transformers' `LlamaAttention.forward`, with the norms over each
    head of q and k of Qwen3 and Gemma 3 where it has them, and Gemma 2's soft-capped scores) with q, k and v in one
    pass. Transformers' eager attention, where a model runs it, is Gemma 2's (Llama's, plus the cap)."""

    def __init__(self, attention: nn.Module, qkv: list[nn.Module] | StackedProjection) -> None:
        super().__init__()
        # the attention function: a model of our own names it (`packed_model.attention_parts`), transformers' models
        # look theirs up by the config's name on each pass
        self.attend = getattr(attention, "attend", None)
        for name in ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling", "attention_dropout",
                     "is_causal"):
            setattr(self, name, getattr(attention, name))
        config = attention.config
        # Qwen2, Qwen3 and Gemma 3 say it per layer; Mistral and Phi-3 read their config's
        self.sliding_window = getattr(attention, "sliding_window", getattr(config, "sliding_window", None))
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.qkv = qkv if isinstance(qkv, StackedProjection) else StackedProjection(qkv)
        self.o_proj = attention.o_proj
        self.q_norm, self.k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        self.softcap = getattr(config, "attn_logit_softcapping", None)  # Gemma 2: cap · tanh(score / cap)
        self.native_rotary = self.head_dim % 32 == 0 and layer_ops.available()

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache=None, past_key_values=None,
                **kwargs) -> tuple[torch.Tensor, None]:
        # transformers >= 5.24 names the cache `cache` (`past_key_values` before)
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]  # [B, T]
        qkv = self.qkv(hidden_states).to(hidden_states.dtype)  # [B, T, q + 2 kv]
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head of q and k normed before the rotation
            query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            query = self.q_norm(query.reshape(*input_shape, -1, self.head_dim)).flatten(-2)
            key = self.k_norm(key.reshape(*input_shape, -1, self.head_dim)).flatten(-2)
            qkv = torch.cat([query, key, value], dim=-1)  # [B, T, q + 2 kv]
        cos, sin = position_embeddings  # [B, T, d]
        native_rotary = self.native_rotary and qkv.shape[0] == 1 and qkv.dtype == cos.dtype == torch.bfloat16
        if native_rotary:  # q and k heads rotated in place, in one call
            layer_ops.rotary_(qkv, (self.q_size + self.kv_size) // self.head_dim, self.head_dim, cos, sin)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(*input_shape, -1, self.head_dim).transpose(1, 2)  # [B, heads, T, d]
        key = key.view(*input_shape, -1, self.head_dim).transpose(1, 2)  # [B, kv_heads, T, d]
        value = value.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if not native_rotary:
            query, key = rotate(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attend = self.attend
        if attend is None:
            parts = transformers_parts()
            attend = parts.attention_functions.get_interface(self.config._attn_implementation, parts.eager_attention)
        output, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                           sliding_window=self.sliding_window, softcap=self.softcap, **kwargs)  # [B, T, heads, d]
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), None


class NativeRMSNorm(nn.Module):
    """A family's RMSNorm in one C call (`layer_ops`), bf16 on the CPU only: Llama's `w ⊙ bf16(x / rms(x))`, or
    given an `offset`, Gemma's `bf16(x / rms(x) · gain)` with `gain = offset + w` in float32, computed here once
    (as Gemma's norm computes it each call)."""

    def __init__(self, norm: nn.Module, offset: float | None = None) -> None:
        super().__init__()
        self.weight = norm.weight
        eps = getattr(norm, "variance_epsilon", None)
        self.variance_epsilon = norm.eps if eps is None else eps  # Gemma's norms call it `eps`
        gain = None if offset is None else offset + norm.weight.detach().float()  # [dim] float32
        self.register_buffer("gain", gain, persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., H] bf16
        if self.gain is None:
            return layer_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return layer_ops.rms_norm_gain(hidden_states, self.gain, self.variance_epsilon)


def _native_norm(norm: nn.Module, arch: Architecture) -> nn.Module:
    """`norm` as a `NativeRMSNorm` of its family's formula where the kernel takes it, else `norm` itself."""
    weight = getattr(norm, "weight", None)
    if isinstance(norm, RMSNorm):
        family_norm = norm.kind == arch.rms_norm
    else:
        family_norm = _from_transformers(norm) and isinstance(norm, transformers_parts().rms_norms[arch.rms_norm])
    if not (family_norm and weight is not None and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[-1] % 16 == 0 and layer_ops.available()):
        return norm
    return NativeRMSNorm(norm, arch.norm_offset if arch.rms_norm == "gemma" else None)


def _stackable_parts(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]] | None:
    """A layer's q|k|v and gate|up projections in stacking order, if each runs on a tile kernel and the layer's
    rotary turns whole heads (Phi-4-mini turns part of each); else None."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv = [attention.qkv_proj] if hasattr(attention, "qkv_proj") else [
        getattr(attention, f"{n}_proj", None) for n in "qkv"]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [
        getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)]
    if any(p is None or run_kind(p) is None for p in qkv + gate_up):
        return None
    config = attention.config
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        return None
    return qkv, gate_up


def held_tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Every tensor the modules hold: buffers, parameters, and their packed matrices' (a `TileLinear`'s `packed`)."""
    tensors = []
    for module in modules:
        for part in module.modules():
            tensors += [*part.buffers(recurse=False), *part.parameters(recurse=False)]
            packed = getattr(part, "packed", None)
            if packed is not None and not isinstance(packed, torch.Tensor):
                tensors += [value for value in vars(packed).values() if isinstance(value, torch.Tensor)]
    return tensors


def fast_decoder_layers(model: nn.Module) -> int:
    """Swap a stacked family's norms for `NativeRMSNorm` where it runs, and each decoder layer's
    attention and MLP for stacked ones where every projection runs on a tile kernel (outputs of the
    projections unchanged); returns how many layers had their projections stacked."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    arch = stacked_architecture(model.config)
    if layers is None or arch is None:
        return 0
    model.__dict__.pop(FUSED_ATTRIBUTE, None)  # what fused_decoder kept describes the layers as they were
    model.model.norm = _native_norm(model.model.norm, arch)
    stacked = 0
    for layer in layers:
        for name in filter(None, LAYER_NORMS[arch.layer_shape]):
            setattr(layer, name, _native_norm(getattr(layer, name), arch))
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, name, None)
            if norm is not None:
                setattr(layer.self_attn, name, _native_norm(norm, arch))
        parts = _stackable_parts(layer)
        if parts is None:
            continue
        mlp = layer.mlp
        act_fn = getattr(mlp, "act_fn", None) or mlp.activation_fn  # Phi-3 names it activation_fn
        layer.self_attn = StackedAttention(layer.self_attn, parts[0])
        layer.mlp = StackedMLP(parts[1], mlp.down_proj, act_fn)
        # the replaced projections' memory goes back now, not at the end of loading: mapped from a kept file, or made
        # by the loader
        drop_file_pages(held_tensors(parts[0] + parts[1]))
        trim_heap()
        stacked += 1
    return stacked
