"""Per-token decoder-layer operations in C for bf16 activations: RMSNorm (Llama's and Gemma's), rotary embedding
(`layer_ops.c` with AVX-512 BF16, else `layer_ops_avx2.c`)."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels import isa
from specdraft.kernels.build import compiled_library

_HERE = Path(__file__).parent
_BUILDS = {  # level -> (source, compiler flags, CPU flags)
    "avx512": (_HERE / "layer_ops.c", ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-shared",
                                       "-fPIC"], {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"}),
    "avx2": (_HERE / "layer_ops_avx2.c", ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"],
             isa.CPU_FLAGS["avx2"]),
}


def _library() -> ctypes.CDLL | None:
    return isa.first_built(_built)


@lru_cache(maxsize=None)
def _built(level: str) -> ctypes.CDLL | None:
    source, flags, required = _BUILDS[level]
    library = compiled_library(source, flags, required, f"the {level} layer operations")
    if library is None:
        return None
    library.rms_norm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.rms_norm_bf16.restype = None
    library.rms_norm_gain_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    library.rms_norm_gain_bf16.restype = None
    library.rotary_bf16.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
    library.rotary_bf16.restype = None
    return library


def available() -> bool:
    """Whether the kernels run on this machine (AVX-512 BF16 or AVX2, as `SPECDRAFT_ISA` allows)."""
    return _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight ⊙ bf16(x / sqrt(mean(x²) + eps))` over the last dimension: x `[..., dim]` bf16 (CPU, dim % 16 == 0),
    weight `[dim]` bf16 -> bf16 `[..., dim]`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _library().rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rms_norm_gain(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf16(x / sqrt(mean(x²) + eps) · gain)` over the last dimension, the products in float32 (Gemma's RMSNorm,
    gain = 1 + w): x `[..., dim]` bf16 (CPU, dim % 16 == 0), gain `[dim]` float32 -> bf16 `[..., dim]`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _library().rms_norm_gain_bf16(x.data_ptr(), gain.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rotary_(rows: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on the first `heads` heads of size `dim` of each row: rows `[1, T, ≥ heads·dim]`
    bf16 contiguous (a stacked q|k|v output), cos and sin `[1, T, dim]` bf16; the bits of transformers'
    `apply_rotary_pos_emb` in bf16."""
    if not rows.is_contiguous() or rows.shape[-1] < heads * dim or dim % 32:
        raise ValueError(f"rotary_ needs contiguous rows of at least {heads}·{dim} values, dim % 32 == 0")
    cos, sin = cos.contiguous(), sin.contiguous()
    _library().rotary_bf16(rows.data_ptr(), rows.shape[1], rows.shape[-1], heads, dim, cos.data_ptr(), sin.data_ptr())
