"""A stacked model's decoder layers (pre-norm: Llama, Mistral, Qwen2, Qwen3, Phi-3; sandwich: Gemma 2 and 3;
`models/architectures.py`) as one C call for passes of a few tokens (`kernels/decoder_layers`: AVX-512 or AVX2).

After `fast_layers.fast_decoder_layers`, every projection of a packed model runs on a tile kernel,
yet a decoding step still spent about a sixth of its time (the bundled 0.5B draft: a third) in
Python and PyTorch dispatch between the kernels. `FusedDecoder` hands the whole layer stack to C:
the embedding, rotary tables, final norm and LM head stay in PyTorch (once a pass), the layers run
without returning. It computes what the PyTorch path computes, bit for bit (tested), and writes
the pass's keys and values into the model's `GrowingLayer` caches in place, so the two paths can
take turns on one cache.

`fused_decoder(model)` builds one for a model whose every layer qualifies (stacked attention and
MLP on our tile kernels (AMX, AVX-512 or AVX2), native norms (over each head of q and k too, where it has them),
SiLU or a tabled activation (`fast_layers.StackedMLP`)), else returns None; sliding-window layers attend
to their window (each its own rotary table where the family declares one per layer type); Gemma 2's soft-caps are
computed, its attention scores' in C, its logits' after the head (`FusedDecoder.logits`). It is kept on the model
(not in its copies) and rebuilt when `fast_decoder_layers` changes the layers.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.kernels import decoder_layers, dense_matmul, gguf_matmul
from specdraft.kernels.int4_layout import PackedInt4
from specdraft.models.architectures import LAYER_NORMS, stacked_architecture
from specdraft.models.fast_layers import (CODE_MATMULS, FUSED_ATTRIBUTE, STORED_LINEARS, NativeRMSNorm,
                                          StackedAttention, StackedMLP, StackedProjection)
from specdraft.models.quantize import Int4Linear, SplitInt4Linear


def _runs(projection: nn.Module) -> tuple[list[tuple[int, object]], torch.Tensor | None] | None:
    """A projection as (kind, packed matrix) runs and its float32 bias, or None if it is not all on the tile kernels
    of the decoder build that runs here."""
    int4_kinds, q6k_kind = decoder_layers.int4_kinds(), decoder_layers.q6k_kind()
    if isinstance(projection, StackedProjection):
        runs = []
        for matmul, packed in projection.runs:
            if matmul in int4_kinds and isinstance(packed, PackedInt4):
                runs.append((_affine_kind(int4_kinds[matmul], packed), packed))
            elif matmul is gguf_matmul.block_matmul and q6k_kind is not None:
                runs.append((q6k_kind, packed))
            elif matmul is dense_matmul.dense_matmul and q6k_kind is not None:  # the build is the tile kernel's
                runs.append((_dense_kind(packed), packed))
            elif (matmul in CODE_MATMULS
                  and (code_kind := decoder_layers.code_kind(packed.type_name)) is not None):
                runs.append((code_kind, packed))
            else:
                return None
        return runs, projection.bias
    bias = None if projection.bias is None else projection.bias.detach().float().contiguous()
    if isinstance(projection, SplitInt4Linear):
        projection = projection.halves
    if isinstance(projection, Int4Linear):
        if projection.tiles is None or projection.dense_weight is not None or projection.tile_matmul not in int4_kinds:
            return None
        return [(_affine_kind(int4_kinds[projection.tile_matmul], projection.tiles), projection.tiles)], bias
    if isinstance(projection, gguf_matmul.BlockLinear) and q6k_kind is not None:
        return [(q6k_kind, projection.packed)], bias
    if isinstance(projection, dense_matmul.DenseLinear) and q6k_kind is not None:
        return [(_dense_kind(projection.packed), projection.packed)], bias
    if isinstance(projection, STORED_LINEARS) and not isinstance(projection, dense_matmul.DenseLinear) and (
            code_kind := decoder_layers.code_kind(projection.type_name)) is not None:
        return [(code_kind, projection.packed)], bias
    return None


def _dense_kind(packed: dense_matmul.PackedDense) -> int:
    """The run kind of F16, BF16 or F32 dense tiles (every decoder build has their kernel)."""
    return getattr(decoder_layers, packed.type_name)


def _affine_kind(int4_kind: int, packed: PackedInt4) -> int:
    """The run kind of a 4- or 5-bit matrix on the kernel whose 4-bit kind is `int4_kind`."""
    if packed.bits == 4:
        return int4_kind
    return decoder_layers.INT5_AMX if int4_kind == decoder_layers.INT4_AMX else decoder_layers.INT5


def _describe(target: decoder_layers.Projection, runs: list[tuple[int, object]], bias: torch.Tensor | None,
              in_features: int) -> None:
    target.bias = 0 if bias is None else bias.data_ptr()
    target.runs = len(runs)
    for slot, (kind, packed) in zip(target.run, runs):
        slot.kind, slot.tiles, slot.rows = kind, packed.tiles.data_ptr(), packed.out_features
        slot.doubled = int(packed.in_features == 2 * in_features)  # split 4-bit halves read [x, x]
        if kind in (decoder_layers.INT4, decoder_layers.INT4_AMX, decoder_layers.INT5_AMX, decoder_layers.INT5):
            slot.scale, slot.zero = packed.scale.data_ptr(), packed.zero.data_ptr()
        elif kind in (decoder_layers.F16, decoder_layers.BF16, decoder_layers.F32):
            slot.scale, slot.zero = 0, 0
        elif kind in (decoder_layers.Q8_0, decoder_layers.IQ4, decoder_layers.Q4_0, decoder_layers.Q5_0):
            slot.scale, slot.zero = packed.steps.data_ptr(), 0
        elif kind in (decoder_layers.Q4K, decoder_layers.Q5K):
            slot.scale, slot.zero = packed.marks.data_ptr(), packed.steps.data_ptr()
        else:
            slot.scale, slot.zero = packed.d.data_ptr(), 0


def _norm_pointer(norm: NativeRMSNorm | None) -> int:
    """Where the C stack reads a norm: its float32 gain (Gemma's), its bf16 weight (Llama's), or 0 for none."""
    if norm is None:
        return 0
    return (norm.weight if norm.gain is None else norm.gain).data_ptr()


class FusedDecoder:
    """Runs a stacked model's decoder layers for a pass of a few tokens in one C call."""

    def __init__(self, model: nn.Module, layer_projections: list[list[tuple[list, torch.Tensor | None]]]) -> None:
        base, config = model.model, model.config
        arch = stacked_architecture(config)
        self.layers = base.layers  # the list these describe (an early-exit view has its own)
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.head = model.get_output_embeddings()
        attention, mlp = base.layers[0].self_attn, base.layers[0].mlp
        self.head_dim, self.kv_heads = attention.head_dim, attention.kv_size // attention.head_dim
        self.sizes = (config.hidden_size, attention.q_size // attention.head_dim, self.kv_heads, self.head_dim,
                      mlp.intermediate)
        self.eps, self.scaling = float(base.layers[0].input_layernorm.variance_epsilon), float(attention.scaling)
        self.softcap = attention.softcap  # the attention's scores', or None
        self.final_softcap = getattr(config, "final_logit_softcapping", None)  # the logits', or None
        self.norm_gains = base.layers[0].input_layernorm.gain is not None
        self.activation = None if mlp.silu else mlp.activation_table  # [65537] int16, or None for SiLU
        # the rotary table each layer reads: its layer type's, or one for all (None)
        self.rotary_kinds = ([config.layer_types[layer.self_attn.layer_idx] for layer in base.layers]
                             if arch.rotary_per_layer_type else [None] * len(base.layers))
        self.table = (decoder_layers.Layer * len(base.layers))()
        self._alive = []  # tensors the table points to (biases converted here)
        for entry, layer, projections in zip(self.table, base.layers, layer_projections):
            norms = [getattr(layer, name) if name else None for name in LAYER_NORMS[arch.layer_shape]]
            entry.input_norm, entry.attention_out_norm, entry.mlp_norm, entry.mlp_out_norm = map(_norm_pointer, norms)
            entry.q_norm, entry.k_norm = _norm_pointer(layer.self_attn.q_norm), _norm_pointer(layer.self_attn.k_norm)
            entry.window = layer.self_attn.sliding_window or 0
            inputs = (config.hidden_size, attention.q_size, config.hidden_size, layer.mlp.intermediate)
            for name, (runs, bias), in_features in zip(("qkv", "o", "gate_up", "down"), projections, inputs):
                _describe(getattr(entry, name), runs, bias, in_features)
                self._alive.append(bias)
        self._feature_index: tuple[tuple[int, ...], torch.Tensor] | None = None  # layers asked last, as [n] int64

    def _feature_tensor(self, layers: tuple[int, ...]) -> torch.Tensor:
        """`layers` as the `[n]` int64 index the C stack reads, made once for each set a drafter asks for."""
        if self._feature_index is None or self._feature_index[0] != layers:
            if any(not 0 <= i < len(self.table) for i in layers):
                raise SpecdraftError(f"These fused layers are {len(self.table)}: their inputs are 0 .. "
                                     f"{len(self.table) - 1}, not {list(layers)}.")
            self._feature_index = layers, torch.tensor(layers, dtype=torch.int64)
        return self._feature_index[1]

    @torch.inference_mode()
    def run(self, cache, cache_len: int, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
            feature_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-normed hidden states `[1, T, H]` of `tokens` `[1, T]` at `positions` `[1, T]`, their keys and
        values appended to `cache` (which holds `cache_len` tokens); `mask` `[T, cache_len + T]` additive float32,
        or None for a causal pass. With `feature_layers`, also the states entering those layers side by side
        `[1, T, n * H]` (transformers' `hidden_states[i]`; the stack copies them out on its way), else None."""
        length = tokens.shape[1]
        hidden = self.embed(tokens)[0].contiguous()  # [T, H] bf16
        rotary = {}  # layer type (None: every layer) -> (cos, sin) [T, d] each
        for kind in dict.fromkeys(self.rotary_kinds):
            cos, sin = self.rotary(hidden, positions) if kind is None else self.rotary(hidden, positions, kind)
            rotary[kind] = cos[0].contiguous(), sin[0].contiguous()  # [1, T, d] -> [T, d]
        template = hidden.new_empty((1, self.kv_heads, 0, self.head_dim))
        for entry, layer, kind in zip(self.table, cache.layers, self.rotary_kinds):
            if layer.reserve(template, template, length) != cache_len:
                raise RuntimeError("the cache does not hold cache_len tokens")
            entry.keys, entry.values = layer.key_buffer.data_ptr(), layer.value_buffer.data_ptr()
            entry.capacity = layer.key_buffer.shape[-2]
            entry.cos, entry.sin = rotary[kind][0].data_ptr(), rotary[kind][1].data_ptr()
        index = None if feature_layers is None else self._feature_tensor(feature_layers)  # [n] int64
        features = decoder_layers.run_layers(self.table, hidden, self.sizes, self.eps, self.scaling, self.softcap,
                                             cache_len, self.norm_gains, self.activation, mask, index)  # [T, n * H]
        for layer in cache.layers:
            layer.advance(cache_len + length)
        return self.norm(hidden).unsqueeze(0), None if features is None else features.unsqueeze(0)  # [1, T, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [1, T, H] final-normed -> [1, T, V]
        """The LM head's logits, soft-capped where the family's head caps them (Gemma 2: `cap · tanh(logits / cap)`,
        in transformers' operations and dtype, so in its bits)."""
        logits = self.head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _head_norms_fit(attention: StackedAttention, layer: nn.Module) -> bool:
    """The attention has no norms over q's and k's heads, or native ones with the layer norms' epsilon."""
    if attention.q_norm is None and attention.k_norm is None:
        return True
    eps = layer.input_layernorm.variance_epsilon
    return all(isinstance(norm, NativeRMSNorm) and norm.variance_epsilon == eps
               for norm in (attention.q_norm, attention.k_norm))


def _qualifies(model: nn.Module) -> list | None:
    """Per layer, its four projections as runs (see `_runs`), if every layer can run fused; else None."""
    base = getattr(model, "model", None)
    config = getattr(model, "config", None)
    layers = getattr(base, "layers", None)
    arch = None if config is None else stacked_architecture(config)
    if (not layers or arch is None or not decoder_layers.available()
            or not isinstance(getattr(base, "norm", None), NativeRMSNorm)):
        return None
    described = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        if not (isinstance(attention, StackedAttention) and isinstance(mlp, StackedMLP) and attention.native_rotary
                and (mlp.silu or mlp.activation_table is not None) and _head_norms_fit(attention, layer)
                and attention.head_dim <= decoder_layers.MAX_HEAD_DIM
                and all(isinstance(getattr(layer, name), NativeRMSNorm)
                        for name in LAYER_NORMS[arch.layer_shape] if name)):
            return None
        projections = [_runs(p) for p in (attention.qkv, attention.o_proj, mlp.gate_up, mlp.down_proj)]
        if any(p is None or len(p[0]) > decoder_layers.MAX_RUNS for p in projections):
            return None
        described.append(projections)
    return described


class _Kept:
    """What `fused_decoder` keeps on a model: the layer list it looked at and its verdict. Not copied with
    the model (a copy's tensors lie elsewhere)."""

    def __init__(self, layers: nn.Module | None, fused: FusedDecoder | None) -> None:
        self.layers, self.fused = layers, fused

    def __deepcopy__(self, memo) -> None:
        return None


def fused_decoder(model: nn.Module) -> FusedDecoder | None:
    """The model's FusedDecoder (built on first use), or None where its layers cannot run fused."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    kept = model.__dict__.get(FUSED_ATTRIBUTE)
    if kept is None or kept.layers is not layers:  # an early-exit view has a list of its own
        described = _qualifies(model)
        kept = _Kept(layers, FusedDecoder(model, described) if described is not None else None)
        model.__dict__[FUSED_ATTRIBUTE] = kept
    return kept.fused
