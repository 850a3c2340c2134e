"""Weights in 4-bit and Q6_K tiles multiplied on Intel AMX tiles (`amx_tiles.c`): a flat cost from 1 to 16 tokens.

- 4-bit: the layout of `int4_layout.pack` (shared with `avx512_tiles`); `matmul(packed, x)` is
  `x @ W^T` in float32.
- Q6_K: the tiles of `gguf_matmul.pack_q6k`; `q6k_matmul` likewise.

The C file is compiled on first use (kernels/build.py); where AMX is missing or not granted by the
operating system, `available()` is False and callers take `avx512_tiles` or PyTorch's kernel.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels import isa
from specdraft.kernels.build import bind, compiled_library
from specdraft.kernels.int4_layout import PAIRS, PackedInt4, run_tile_kernel

TILE_LAYOUT = PAIRS  # how 4-bit and Q6_K tiles are laid out for these kernels (`int4_layout`, `gguf_matmul`)
_SOURCE = Path(__file__).with_name("amx_tiles.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared",
          "-fPIC"]
REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "int4_amx_matmul": [_POINTER] * 5 + [_SIZE] * 3,  # tiles, scale, zero, x, y, N, K, tokens
    "q6k_amx_matmul": [_POINTER] * 4 + [_SIZE] * 3,  # tiles, d, x, y, N, K, tokens
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = compiled_library(_SOURCE, _FLAGS, REQUIRED_CPU_FLAGS, "the AMX tile kernels")
    if library is None or library.amx_tiles_init() != 0:  # the OS must grant the tile state
        return None
    return bind(library, _SIGNATURES)


def available() -> bool:
    """Whether the AMX tile kernels run on this machine (and `SPECDRAFT_ISA` allows them)."""
    return isa.allows("amx") and _library() is not None


def _loaded() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the AMX tile kernels are not available on this machine")
    return library


def matmul(packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for 4-bit tiles: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    return run_tile_kernel(_loaded().int4_amx_matmul, packed, x, TILE_LAYOUT)


def q6k_matmul(tiles: torch.Tensor, d: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x @ W^T` for Q6_K tiles (`gguf_matmul.pack_q6k`): x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    x = x.to(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    _loaded().q6k_amx_matmul(tiles.data_ptr(), d.data_ptr(), x.data_ptr(), out.data_ptr(), out_features, x.shape[1],
                             x.shape[0])
    return out
