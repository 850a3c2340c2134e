"""A stack of decoder layers in one C call for passes of a few bf16 tokens: the layer of
`native/shared/decoder_layers.h` in the library that runs (`NumericConfig.library`: AVX-512, with AMX where granted,
or AVX2), on that library's kernels.

The C side runs the tile kernels, norms, rotary embedding, attention and activation of every layer
without returning to Python; `models/fused_decoder.py` describes a model's layers to it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

from specdraft.kernels import bindings, numerics, prompt_pass, tiles

MAX_RUNS = 3  # runs of one kind a projection may have (as in the C file)
MAX_HEAD_DIM = 256  # the attention kernel's largest head (MAX_DIM in the attention C files)
# run kinds (the AMX ones only where `tiles.AMX` runs; the code tiles Q8_0 and IQ4, and Q4_K's and Q4_0's, where the
# AVX2 or the AVX-512 tile kernel runs)
INT4, Q6K, INT4_AMX, Q6K_AMX, INT5_AMX, INT5, F16, BF16, F32, Q8_0, IQ4, Q4K, Q4_0, Q5K, Q5_0 = range(15)
_STORED_KINDS = {"Q8_0": Q8_0, "IQ4_NL": IQ4, "IQ4_XS": IQ4, "Q4_K": Q4K, "Q5_K": Q5K, "Q4_0": Q4_0, "Q5_0": Q5_0}
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


class Run(ctypes.Structure):
    """Rows of one kind of a projection: `kind` (INT4 / Q6K), its tiles, scales (and 4-bit zeros), row count, and
    whether they are 4-bit halves side by side that read each input twice (`SplitInt4Linear`)."""

    _fields_ = [("kind", _SIZE), ("tiles", _POINTER), ("scale", _POINTER), ("zero", _POINTER), ("rows", _SIZE),
                ("doubled", _SIZE)]


class Projection(ctypes.Structure):
    """A projection as runs of rows, with an optional float32 bias."""

    _fields_ = [("bias", _POINTER), ("runs", _SIZE), ("run", Run * MAX_RUNS)]


class Layer(ctypes.Structure):
    """One decoder layer: its norms before the attention and the MLP, four projections, the layer's key/value cache
    buffers, its norms over each head of q and k (Qwen3's, Gemma 3's; None where it has none) and of the attention's
    and the MLP's outputs (Gemma's sandwich; None where it has none), its rotary table for the pass, and its sliding
    window (0: none). A norm is its bf16 weight, or its float32 gain where the pass runs `norm_gains`."""

    _fields_ = [("input_norm", _POINTER), ("mlp_norm", _POINTER), ("qkv", Projection), ("o", Projection),
                ("gate_up", Projection), ("down", Projection), ("keys", _POINTER), ("values", _POINTER),
                ("capacity", _SIZE), ("q_norm", _POINTER), ("k_norm", _POINTER), ("attention_out_norm", _POINTER),
                ("mlp_out_norm", _POINTER), ("cos", _POINTER), ("sin", _POINTER), ("window", _SIZE)]


def level() -> str | None:
    """The instruction set of the library that runs here (`avx512`, with AMX where granted, or `avx2`), or None."""
    config = numerics.current()
    return next((chosen for chosen in ("avx512", "avx2") if config.library(chosen) is not None), None)


def _library() -> ctypes.CDLL | None:
    return numerics.current().library()


def same_silu_as_torch() -> bool:
    """Whether SiLU here uses PyTorch's own exp (so it gives PyTorch's bits)."""
    chosen = level()
    return chosen is not None and bindings.same_exp_as_torch(bindings.Build(chosen))


def available() -> bool:
    """Whether the fused decoder layers run on this machine (AVX-512 or AVX2, as `SPECDRAFT_ISA` allows)."""
    return level() is not None


def int4_kinds() -> dict:
    """The 4-bit tile functions the loaded build runs, as run kinds: {matmul function: kind}."""
    chosen = level()
    if chosen == "avx512":
        return {tiles.AVX512.matmul: INT4, tiles.AMX.matmul: INT4_AMX}
    return {tiles.AVX2.matmul: INT4} if chosen == "avx2" else {}


def q6k_kind() -> int | None:
    """The run kind of Q6_K matrices (on the kernel `gguf_matmul.block_matmul` runs them on here), or None where the
    loaded build does not have that kernel."""
    kernel, chosen = tiles.tile_kernel(), level()
    if chosen == "avx512" and kernel in (tiles.AMX, tiles.AVX512):
        return Q6K_AMX if kernel is tiles.AMX else Q6K
    return Q6K if chosen == "avx2" and kernel is tiles.AVX2 else None


def code_kind(type_name: str) -> int | None:
    """The run kind of tiles that keep a file's `type_name` blocks as stored (`int8_codes`: Q8_0, IQ4_NL, IQ4_XS;
    `q4k_tiles`: Q4_K, Q5_K, Q4_0, Q5_0), or None where the loaded build does not run their kernel (the AVX2 and AVX-512 tile kernels
    do, AMX does not)."""
    kernel = tiles.tile_kernel()
    return _STORED_KINDS[type_name] if tiles.runs_stored_weights() and kernel.name == level() else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`bf16(bf16(silu(gate)) · up)` of a stacked gate|up `[..., 2I]` bf16 -> `[..., I]` bf16 (I % 16 == 0)."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    _library().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return out


def activation_table(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """PyTorch's bf16 values of an elementwise activation for every bf16 input, indexed by the input's bits:
    `[65537]` int16 (the last entry pads the C side's 4-byte reads), for `act_mul`."""
    inputs = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)  # [65536]
    with torch.inference_mode():
        values = act_fn(inputs).view(torch.int16)
    return torch.cat([values, values.new_zeros(1)])


def act_mul(gate_up: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`bf16(act(gate) · up)` of a stacked gate|up `[..., 2I]` bf16 -> `[..., I]` bf16 (I % 16 == 0), act(gate) read
    from `activation_table(act)`: PyTorch's bits of `act(gate) * up` wherever act(gate) and the product lie in
    float32's normal range (tested for every bf16 gate)."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    _library().act_mul_bf16(gate_up.data_ptr(), table.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return out


def int8_projections(chosen: str | None = None) -> bool:
    """Whether this pass's projections run on int8 activations: inside a pass context (`prompt_pass`) with no
    precise leading row, as the tile kernels of the PyTorch path would there (every library has them: its
    `int8_tiles.h`; `chosen`, default `level()`, is the loaded library's level)."""
    return prompt_pass.precise_rows() == 0 and (chosen or level()) is not None


def run_layers(layers: ctypes.Array, hidden: torch.Tensor, sizes: tuple[int, int, int, int, int], eps: float,
               scaling: float, softcap: float | None, cache_len: int, norm_gains: bool, activation: torch.Tensor | None,
               mask: torch.Tensor | None, feature_layers: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run `hidden` `[T, H]` bf16 (contiguous) through `layers` in place; with `feature_layers` `[n]` int64 (indices
    into `layers`), return the rows entering each of them side by side `[T, n * H]` bf16 (transformers'
    `hidden_states[i]`, copied out on the way at the cost of a row copy), else None.

    sizes: (hidden, heads, kv_heads, head_dim, intermediate); softcap: the cap of the attention's scores
    (`cap · tanh(score / cap)`, Gemma 2), or None; norm_gains: every norm is Gemma's (its entries float32
    gains), else Llama's (bf16 weights); activation: None for SiLU, else an `activation_table`; mask
    `[T, cache_len + T]` float32 additive, or None for a causal pass. Each layer's caches (`keys`, `values`,
    `capacity` in its entry) must have room for cache_len + T tokens, and its `cos` and `sin` `[T, head_dim]` bf16
    hold its rotary table for the pass. Inside a pass context, projections run as `int8_projections()` says.
    """
    count = 0 if feature_layers is None else feature_layers.numel()
    features = hidden.new_empty((hidden.shape[0], count * sizes[0])) if count else None  # [T, n * H]
    library = _library()
    library.use_int8_activations(int8_projections(level()))
    library.decoder_layers_forward(ctypes.addressof(layers), len(layers), hidden.data_ptr(), hidden.shape[0],
                                   *sizes, eps, scaling, softcap or 0.0, cache_len, int(norm_gains),
                                   0 if activation is None else activation.data_ptr(),
                                   0 if mask is None else mask.data_ptr(),
                                   0 if features is None else feature_layers.data_ptr(), count,
                                   0 if features is None else features.data_ptr())
    return features
