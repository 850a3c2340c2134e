"""4-bit group weights multiplied on Intel AMX tiles (`int4_amx.c`): a flat cost from 1 to 16 tokens.

`pack(codes, scale, minimum)` lays a matrix out for the kernel (the same bytes as 4-bit codes
plus a bf16 scale and offset per group of 32); `matmul(packed, x)` is `x @ W^T` in float32. The
C file is compiled on first use (kernels/build.py); where AMX is missing or not granted by the
operating system, `available()` is False and callers take `avx512_tiles` or PyTorch's kernel.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels.build import compiled_library
from specdraft.kernels.int4_layout import PackedInt4, run_tile_kernel

_SOURCE = Path(__file__).with_name("int4_amx.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared",
          "-fPIC"]
REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = compiled_library(_SOURCE, _FLAGS, REQUIRED_CPU_FLAGS, "the AMX int4 kernel")
    if library is None or library.int4_amx_init() != 0:  # the OS must grant the tile state
        return None
    library.int4_amx_matmul.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    library.int4_amx_matmul.restype = None
    return library


def available() -> bool:
    """Whether the AMX int4 kernel runs on this machine."""
    return _library() is not None


def matmul(packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T`: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    library = _library()
    if library is None:
        raise RuntimeError("the AMX int4 kernel is not available on this machine")
    return run_tile_kernel(library.int4_amx_matmul, packed, x)
