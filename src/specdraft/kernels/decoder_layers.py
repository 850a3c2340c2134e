"""A stack of decoder layers in one C call for passes of a few bf16 tokens: `decoder_avx512.c` (with AMX where
granted) or `decoder_avx2.c`, the one layer of `decoder_layers.h` on each instruction set's kernels.

The C side runs the tile kernels, norms, rotary embedding, attention and activation of every layer
without returning to Python; `models/fused_decoder.py` describes a model's layers to it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specdraft.kernels import amx_tiles, avx2_tiles, avx512_tiles, isa, prompt_pass, tiles
from specdraft.kernels.build import compiled_library
from specdraft.kernels.tile_dots import build_options, dots

_HERE = Path(__file__).parent
_BUILDS = {  # level -> (source, compiler flags, CPU flags)
    "avx512": (_HERE / "decoder_avx512.c",
               ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma",
                "-fopenmp", "-shared", "-fPIC"],
               {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni", "fma"}),
    "avx2": (_HERE / "decoder_avx2.c", ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"],
             isa.CPU_FLAGS["avx2"]),
}
_AMX_FLAGS = ["-DWITH_AMX", "-mamx-tile", "-mamx-bf16"]  # the build that may run 4-bit projections on AMX
_TORCH_EXP = {"avx512": "Sleef_expf16_u10", "avx2": "Sleef_expf8_u10"}  # PyTorch's exp for the build's vector width
MAX_RUNS = 3  # runs of one kind a projection may have (as in the C file)
MAX_HEAD_DIM = 256  # the attention kernel's largest head (MAX_DIM in the attention C files)
INT4, Q6K, INT4_AMX, Q6K_AMX = 0, 1, 2, 3  # run kinds (the AMX ones only where `amx_tiles.available()`)
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


def _for_level(chosen: str) -> ctypes.CDLL | None:
    """The build of level `chosen` for this machine: AVX-512 with its dot flavour (and AMX where granted)."""
    if chosen == "avx512":
        return _built(chosen, dots(), amx_tiles.available())
    return (isa.avx_vnni() and _built(chosen, "int16", False, True)) or _built(chosen, "int16", False)


def level() -> str | None:
    """The instruction set of the build that runs here (`avx512` or `avx2`), or None."""
    return next((chosen for chosen in _BUILDS if isa.allows(chosen) and _for_level(chosen) is not None), None)


def _library() -> ctypes.CDLL | None:
    chosen = level()
    return None if chosen is None else _for_level(chosen)


@lru_cache(maxsize=None)
def _built(chosen: str, flavour: str, with_amx: bool, avx_vnni: bool = False) -> ctypes.CDLL | None:
    """The decoder layers of level `chosen`; avx512: with the tiles of `flavour` (and AMX); avx2: with AVX-VNNI's
    int8 dot products (`isa.avx_vnni`)."""
    source, flags, required = _BUILDS[chosen]
    what = f"the {chosen.upper().replace('AVX512', 'AVX-512')} decoder layers"
    if avx_vnni:
        flags, required, what = isa.with_avx_vnni(flags, required, what)
    if chosen == "avx512":
        extra, extra_required = build_options(flavour)
        flags, required = flags + extra, required | extra_required
        if with_amx:  # the tile state is granted: the AMX build runs projections on AMX
            flags, required, what = flags + _AMX_FLAGS, required | amx_tiles.REQUIRED_CPU_FLAGS, what + " with AMX"
    library = compiled_library(source, flags, required, what)
    if library is None:
        return None
    library.decoder_layers_forward.argtypes = ([_POINTER, _SIZE, _POINTER] + [_SIZE] * 6 + [ctypes.c_float] * 2
                                               + [_SIZE] * 2 + [_POINTER] * 2)
    library.decoder_layers_forward.restype = None
    library.silu_mul_bf16.argtypes = [_POINTER, _POINTER, _SIZE, _SIZE]
    library.silu_mul_bf16.restype = None
    library.act_mul_bf16.argtypes = [_POINTER] * 3 + [_SIZE] * 2
    library.act_mul_bf16.restype = None
    library.use_exp.argtypes, library.use_exp.restype = [_POINTER], None
    library.use_int8_activations.argtypes, library.use_int8_activations.restype = [_SIZE], None
    torch_exp = _torch_exp(chosen)
    if torch_exp is not None:
        library.use_exp(torch_exp)
    return library


def _torch_exp(chosen: str) -> int | None:
    """The address of SLEEF's float32 exp of the build's vector width in PyTorch's CPU library (what its SiLU
    uses), or None."""
    try:
        function = getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")), _TORCH_EXP[chosen])
        return ctypes.cast(function, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def same_silu_as_torch() -> bool:
    """Whether SiLU here uses PyTorch's own exp (so it gives PyTorch's bits)."""
    chosen = level()
    return chosen is not None and _torch_exp(chosen) is not None


def available() -> bool:
    """Whether the fused decoder layers run on this machine (AVX-512 or AVX2, as `SPECDRAFT_ISA` allows)."""
    return level() is not None


def int4_kinds() -> dict:
    """The 4-bit tile functions the loaded build runs, as run kinds: {matmul function: kind}."""
    chosen = level()
    if chosen == "avx512":
        return {avx512_tiles.matmul: INT4, amx_tiles.matmul: INT4_AMX}
    return {avx2_tiles.matmul: INT4} if chosen == "avx2" else {}


def q6k_kind() -> int | None:
    """The run kind of Q6_K matrices (on the kernel `gguf_matmul.block_matmul` runs them on here), or None where the
    loaded build does not have that kernel."""
    kernel, chosen = tiles.tile_kernel(), level()
    if chosen == "avx512" and kernel in (amx_tiles, avx512_tiles):
        return Q6K_AMX if kernel is amx_tiles else Q6K
    return Q6K if chosen == "avx2" and kernel is avx2_tiles else None


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
    precise leading row, as the tile kernels of the PyTorch path would there (every build has them: AVX2 on
    `avx2_prompt.c`, AVX-512 on `vnni_tiles.c`; `chosen`, default `level()`, is the loaded build's level)."""
    return prompt_pass.precise_rows() == 0 and (chosen or level()) is not None


def run_layers(layers: ctypes.Array, hidden: torch.Tensor, sizes: tuple[int, int, int, int, int], eps: float,
               scaling: float, cache_len: int, norm_gains: bool, activation: torch.Tensor | None,
               mask: torch.Tensor | None) -> None:
    """Run `hidden` `[T, H]` bf16 (contiguous) through `layers` in place.

    sizes: (hidden, heads, kv_heads, head_dim, intermediate); norm_gains: every norm is Gemma's (its entries float32
    gains), else Llama's (bf16 weights); activation: None for SiLU, else an `activation_table`; mask
    `[T, cache_len + T]` float32 additive, or None for a causal pass. Each layer's caches (`keys`, `values`,
    `capacity` in its entry) must have room for cache_len + T tokens, and its `cos` and `sin` `[T, head_dim]` bf16
    hold its rotary table for the pass. Inside a pass context, projections run as `int8_projections()` says.
    """
    chosen = level()
    library = _for_level(chosen)
    library.use_int8_activations(int8_projections(chosen))
    library.decoder_layers_forward(ctypes.addressof(layers), len(layers), hidden.data_ptr(), hidden.shape[0],
                                   *sizes, eps, scaling, cache_len, int(norm_gains),
                                   0 if activation is None else activation.data_ptr(),
                                   0 if mask is None else mask.data_ptr())
