"""A stack of decoder layers in one C call (`decoder_avx512.c`) for passes of a few bf16 tokens.

The C side runs the tile kernels, norms, rotary embedding, attention and SiLU of every layer
without returning to Python; `models/fused_decoder.py` describes a model's layers to it.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels import amx_tiles, isa
from specdraft.kernels.build import compiled_library
from specdraft.kernels.tile_dots import build_options, dots

_SOURCE = Path(__file__).with_name("decoder_avx512.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_AMX_FLAGS = ["-DWITH_AMX", "-mamx-tile", "-mamx-bf16"]  # the build that may run 4-bit projections on AMX
_REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni", "fma"}
MAX_RUNS = 3  # runs of one kind a projection may have (as in the C file)
MAX_HEAD_DIM = 256  # the attention kernel's largest head (MAX_DIM in attention_avx512.c)
INT4, Q6K, INT4_AMX, Q6K_AMX = 0, 1, 2, 3  # run kinds (the AMX ones only where `amx_tiles.available()`)
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


class Run(ctypes.Structure):
    """Rows of one kind of a projection: `kind` (INT4 / Q6K), its tiles, scales (and 4-bit zeros), row count."""

    _fields_ = [("kind", _SIZE), ("tiles", _POINTER), ("scale", _POINTER), ("zero", _POINTER), ("rows", _SIZE)]


class Projection(ctypes.Structure):
    """A projection as runs of rows, with an optional float32 bias."""

    _fields_ = [("bias", _POINTER), ("runs", _SIZE), ("run", Run * MAX_RUNS)]


class Layer(ctypes.Structure):
    """One decoder layer: its two norm weights, four projections and the layer's key/value cache buffers."""

    _fields_ = [("input_norm", _POINTER), ("post_norm", _POINTER), ("qkv", Projection), ("o", Projection),
                ("gate_up", Projection), ("down", Projection), ("keys", _POINTER), ("values", _POINTER),
                ("capacity", _SIZE)]


def _library() -> ctypes.CDLL | None:
    return _built(dots(), amx_tiles.available())


@lru_cache(maxsize=None)
def _built(flavour: str, with_amx: bool) -> ctypes.CDLL | None:  # the tile kernels of `flavour` run its AVX-512 projections
    flags, required = build_options(flavour)
    if with_amx:  # the tile state is granted: the AMX build runs projections on AMX
        library = compiled_library(_SOURCE, _FLAGS + flags + _AMX_FLAGS,
                                   _REQUIRED_CPU_FLAGS | required | amx_tiles.REQUIRED_CPU_FLAGS,
                                   "the AVX-512 decoder layers with AMX")
    else:
        library = compiled_library(_SOURCE, _FLAGS + flags, _REQUIRED_CPU_FLAGS | required, "the AVX-512 decoder layers")
    if library is None:
        return None
    library.decoder_layers_forward.argtypes = ([_POINTER, _SIZE, _POINTER] + [_SIZE] * 6 + [ctypes.c_float] * 2
                                               + [_SIZE] + [_POINTER] * 3)
    library.decoder_layers_forward.restype = None
    library.silu_mul_bf16.argtypes = [_POINTER, _POINTER, _SIZE, _SIZE]
    library.silu_mul_bf16.restype = None
    library.use_exp.argtypes, library.use_exp.restype = [_POINTER], None
    torch_exp = _torch_exp16()
    if torch_exp is not None:
        library.use_exp(torch_exp)
    return library


def _torch_exp16() -> int | None:
    """The address of SLEEF's 16-lane float32 exp in PyTorch's CPU library (what its SiLU uses), or None."""
    try:
        return ctypes.cast(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).Sleef_expf16_u10,
                           ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def same_silu_as_torch() -> bool:
    """Whether SiLU here uses PyTorch's own exp (so it gives PyTorch's bits)."""
    return available() and _torch_exp16() is not None


def available() -> bool:
    """Whether the fused decoder layers run on this machine (and `SPECDRAFT_ISA` allows AVX-512)."""
    return isa.allows("avx512") and _library() is not None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`bf16(bf16(silu(gate)) · up)` of a stacked gate|up `[..., 2I]` bf16 -> `[..., I]` bf16 (I % 16 == 0)."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    _library().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return out


def run_layers(layers: ctypes.Array, hidden: torch.Tensor, sizes: tuple[int, int, int, int, int], eps: float,
               scaling: float, cache_len: int, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor | None) -> None:
    """Run `hidden` `[T, H]` bf16 (contiguous) through `layers` in place.

    sizes: (hidden, heads, kv_heads, head_dim, intermediate); cos/sin `[T, head_dim]` bf16; mask `[T, cache_len + T]`
    float32 additive, or None for a causal pass. Each layer's caches (`keys`, `values`, `capacity` in its entry) must
    have room for cache_len + T tokens.
    """
    _library().decoder_layers_forward(ctypes.addressof(layers), len(layers), hidden.data_ptr(), hidden.shape[0],
                                      *sizes, eps, scaling, cache_len, cos.data_ptr(), sin.data_ptr(),
                                      0 if mask is None else mask.data_ptr())
