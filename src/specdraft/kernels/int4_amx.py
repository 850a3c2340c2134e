"""4-bit group weights multiplied on Intel AMX tiles (`int4_amx.c`): a flat cost from 1 to 16 tokens.

`pack(codes, scale, minimum)` lays a matrix out for the kernel (the same bytes as 4-bit codes
plus a bf16 scale and offset per group of 32); `matmul(packed, x)` is `x @ W^T` in float32. The
C file is compiled on first use (kernels/build.py); where AMX is missing or not granted by the
operating system, `available()` is False and callers keep PyTorch's int4 kernel.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels.build import compiled_library

_SOURCE = Path(__file__).with_name("int4_amx.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared", "-fPIC"]
_REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "amx_tile", "amx_bf16"}
GROUP = 32  # inputs per scale and minimum
BLOCK_ROWS = 16  # outputs per tile
_PACK_ROWS = 4096  # rows packed at a time (a multiple of BLOCK_ROWS)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = compiled_library(_SOURCE, _FLAGS, _REQUIRED_CPU_FLAGS, "the AMX int4 kernel")
    if library is None or library.int4_amx_init() != 0:  # the OS must grant the tile state
        return None
    library.int4_amx_matmul.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    library.int4_amx_matmul.restype = None
    return library


def available() -> bool:
    """Whether the AMX int4 kernel runs on this machine."""
    return _library() is not None


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a matrix of this shape and group size can be packed for the kernel."""
    return group_size == GROUP and out_features % BLOCK_ROWS == 0 and in_features % (2 * GROUP) == 0


@dataclass
class PackedInt4:
    """A matrix in the kernel's layout: tile bytes `[N/16 · K/32 · 256]` (uint8), scale and zero
    `[N/16, K/32, 16]` (bf16) with w = scale · (q − 8) + zero (zero = 8 · scale − minimum)."""

    tiles: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    out_features: int
    in_features: int


def pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> PackedInt4:
    """From codes `[N, K]` in 0..15 and scale, minimum `[N, K/32]` (see `int4_amx.c` for the layout)."""
    n, k = codes.shape
    if not fits(n, k, k // scale.shape[1]):
        raise ValueError(f"AMX int4 packing needs N % 16 == 0, K % 64 == 0 and groups of 32; got {n}x{k}")
    blocks, groups = n // BLOCK_ROWS, k // GROUP
    tiles = torch.empty(n * k // 2, dtype=torch.uint8)
    tile_scale = torch.empty((blocks, groups, BLOCK_ROWS), dtype=torch.bfloat16)
    tile_zero = torch.empty_like(tile_scale)
    for start in range(0, n, _PACK_ROWS):  # in row slices: the temporaries stay small (a draft's LM head is 136M weights)
        rows = slice(start, min(start + _PACK_ROWS, n))
        part_blocks = (rows.stop - rows.start) // BLOCK_ROWS
        # codes[n0 + c, k0 + 2r + e] -> a byte of tile (nb, g), low nibble e = 0, high nibble e = 1,
        # at 64·(r / 4) + 16·(c / 4) + 4·(r % 4) + c % 4 (the unpacking order of int4_amx.c)
        pairs = codes[rows].to(torch.uint8).view(part_blocks, BLOCK_ROWS, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
        nibbles = pairs[..., 0] | (pairs[..., 1] << 4)  # [blocks, K/32, r = 16, c = 16]
        tiles[rows.start * k // 2: rows.stop * k // 2] = (
            nibbles.view(part_blocks, groups, 4, 4, 4, 4).permute(0, 1, 2, 4, 3, 5).reshape(-1))
        block_range = slice(rows.start // BLOCK_ROWS, rows.stop // BLOCK_ROWS)
        part_scale = scale[rows].float()
        tile_scale[block_range] = part_scale.view(part_blocks, BLOCK_ROWS, groups).permute(0, 2, 1)
        tile_zero[block_range] = (8 * part_scale - minimum[rows].float()).view(part_blocks, BLOCK_ROWS, groups).permute(0, 2, 1)
    return PackedInt4(tiles, tile_scale, tile_zero, n, k)


def matmul(packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T`: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    library = _library()
    if library is None:
        raise RuntimeError("the AMX int4 kernel is not available on this machine")
    x = x.to(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], packed.out_features), dtype=torch.float32)
    library.int4_amx_matmul(packed.tiles.data_ptr(), packed.scale.data_ptr(), packed.zero.data_ptr(),
                            x.data_ptr(), out.data_ptr(), packed.out_features, packed.in_features, x.shape[0])
    return out
