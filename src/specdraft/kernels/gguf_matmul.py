"""Linears that multiply straight from GGUF Q6_K weights, repacked into tiles for the tile kernels (`tiles.AMX` where
the CPU grants AMX, `tiles.AVX512` or `tiles.AVX2`: `tiles.tile_kernel`).

PyTorch has kernels for 4-bit groups (Q4_K runs on them or on ours) but none for Q6_K's 6-bit
codes with a scale per 16 weights. `pack_q6k` rearranges a Q6_K matrix's own bits (codes,
int8 scales, d) into tiles of 16 rows x 32 inputs, 6.5 bits a weight like the file, with no
rounding, laid out as the kernel reads them (its `layout`: `PAIRS` for AMX and AVX-512,
`QUADS` for AVX2, whose int8 kernel then unpacks with masks and shifts alone); where the
kernels cannot build or run, `available()` is False and the loader unpacks
Q6_K to bf16 instead: the same function, slower and 2.4x larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from specdraft.kernels import tiles
from specdraft.kernels.tile_linear import TileLinear, require_input
from specdraft.kernels.int4_layout import PAIRS, QUADS, byte_words, require_layout, tile_bytes
from specdraft.gguf_layout import Q6K_BLOCK_BYTES, QK_K

BLOCK_BYTES = {"Q6_K": Q6K_BLOCK_BYTES}  # bytes per 256 weights of the block types with a kernel here
_TILE_ROWS, _TILE_INPUTS = 16, 32
_PACK_ROWS = 4096  # rows repacked at a time (a multiple of 16): the temporaries stay small


def available() -> bool:
    """Whether a Q6_K tile kernel runs on this machine."""
    return tiles.tile_kernel() is not None


@lru_cache(maxsize=1)
def _high_bit_sources() -> torch.Tensor:
    """For each of a tile's 128 high-bit bytes and 2-bit field f: the (row · 32 + input) whose top two code
    bits go there, `[4 chunks · 32 bytes, 4 fields]` (the order in which `native/avx512/tiles.h` unpacks them).

    Nibble byte 16·L + u of chunk p (L, u < 16) becomes the code bytes 16·L + 2u' + e (u' = u % 8) of pair
    vector u // 8; that pair vector's byte m = 16·L + 2u' + e holds row 4·L + u' % 4, input
    2·(4p + 2·(u // 8) + u' // 4) + e. Fields 0/1 cover bytes m < 32 / m ≥ 32 of pair vector 0, 2/3 of 1."""
    sources = np.zeros((4, 32, 4), dtype=np.int64)
    for chunk in range(4):
        for field in range(4):
            vector, half = divmod(field, 2)
            for j in range(32):
                m = j + 32 * half
                lane, rest = divmod(m, 16)
                u, e = divmod(rest, 2)
                row = 4 * lane + u % 4
                pair = 4 * chunk + 2 * vector + u // 4
                sources[chunk, j, field] = row * _TILE_INPUTS + 2 * pair + e
    return torch.from_numpy(sources.reshape(128, 4))


def _quad_high_bits(high: torch.Tensor) -> torch.Tensor:
    """Top two code bits `[rows, K]` (rows % 16 == 0) as `QUADS` high-bit bytes `[rows / 16, K / 32, 128]`: byte
    32·j + 4·c + b holds, from bit 0 up, those of (row c, input 8j + b), (c, 8j + 4 + b), (8 + c, 8j + b),
    (8 + c, 8j + 4 + b): the bits of the two `vpmaddubsw` operands of both halves of chunk j (`native/avx2/int8_tiles.h`)."""
    rows, k = high.shape
    words = byte_words(high, rows // _TILE_ROWS, 2, 8, k // _TILE_INPUTS, 4, 2)  # [nb, h, c, g, j, e], bytes b
    fields = words[:, 0, ..., 0] | (words[:, 0, ..., 1] << 2) | (words[:, 1, ..., 0] << 4) | (words[:, 1, ..., 1] << 6)
    return fields.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(rows // _TILE_ROWS, k // _TILE_INPUTS, 128)


@dataclass
class PackedQ6K:
    """A Q6_K matrix as tiles: `tiles [N/16 · K/32 · 416]` (uint8) laid out as `layout` says, `d [N/16, K/256, 16]`
    (float32)."""

    tiles: torch.Tensor
    d: torch.Tensor
    out_features: int
    in_features: int
    layout: str = PAIRS
    type_name = "Q6_K"  # the one block type with tiles here (`BLOCK_BYTES`)


def pack_q6k(raw: torch.Tensor, layout: str = PAIRS) -> PackedQ6K:
    """Q6_K rows `[N, K / 256 · 210]` (uint8, N % 16 == 0) -> tiles for the Q6_K kernels that read `layout` (`PAIRS`,
    `QUADS`), without rounding. A tile: 256 bytes of low nibbles (as `int4_layout` lays out 4-bit codes), 128 of top
    bits (`PAIRS`: as `native/avx512/tiles.h` unpacks them; `QUADS`: `_quad_high_bits`), 32 of int8 scales [sub-block][row].

    `raw` is only sliced by rows, 4096 at a time: a loader may pass an object with `shape`, `dtype`
    and row slicing that reads each slice from the file, so the raw matrix is never whole in memory.
    """
    to_bytes = tile_bytes(layout)
    n, row_bytes = raw.shape
    if raw.dtype != torch.uint8 or row_bytes % Q6K_BLOCK_BYTES or n % _TILE_ROWS:
        raise ValueError(f"Q6_K tiles need uint8 [N, K / 256 · {Q6K_BLOCK_BYTES}] with N % 16 == 0; "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    k = row_bytes // Q6K_BLOCK_BYTES * QK_K
    groups = k // _TILE_INPUTS
    tiles = torch.empty((n // _TILE_ROWS, groups, 416), dtype=torch.uint8)
    d_tiles = torch.empty((n // _TILE_ROWS, k // QK_K, _TILE_ROWS), dtype=torch.float32)
    sources = _high_bit_sources()
    for start in range(0, n, _PACK_ROWS):
        part = raw[start:start + _PACK_ROWS]
        rows, blocks = part.shape[0], part.shape[1] // Q6K_BLOCK_BYTES
        view = part.reshape(rows, blocks, Q6K_BLOCK_BYTES)
        low = view[..., :128].reshape(rows, blocks, 2, 1, 64)
        low = torch.cat([low & 0x0F, low >> 4], dim=3).reshape(rows, k)  # [rows, K] low 4 bits
        high = view[..., 128:192].reshape(rows, blocks, 2, 1, 32)
        high = torch.cat([(high >> s) & 0x03 for s in (0, 2, 4, 6)], dim=3).reshape(rows, k)  # [rows, K] top 2 bits
        scales = view[..., 192:208].reshape(rows, groups, 2)  # [rows, K/32, sub-block] int8 bits
        d = view[..., 208:210].contiguous().view(torch.float16).float().reshape(rows, blocks)
        block_slice = slice(start // _TILE_ROWS, (start + rows) // _TILE_ROWS)
        nb = rows // _TILE_ROWS
        tiles[block_slice, :, :256] = to_bytes(low)
        if layout == QUADS:
            tiles[block_slice, :, 256:384] = _quad_high_bits(high)
        else:
            tile_high = high.view(nb, _TILE_ROWS, groups, _TILE_INPUTS).permute(0, 2, 1, 3).reshape(nb, groups, 512)
            fields = tile_high[..., sources]  # [nb, groups, 128, 4]
            tiles[block_slice, :, 256:384] = fields[..., 0] | (fields[..., 1] << 2) | (fields[..., 2] << 4) | (fields[..., 3] << 6)
        tiles[block_slice, :, 384:] = scales.view(nb, _TILE_ROWS, groups, 2).permute(0, 2, 3, 1).reshape(nb, groups, 32)
        d_tiles[block_slice] = d.view(nb, _TILE_ROWS, blocks).permute(0, 2, 1)
    return PackedQ6K(tiles.view(-1), d_tiles, n, k, layout)


def block_matmul(packed: PackedQ6K, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for a Q6_K matrix in tiles; x `[tokens, K]` -> float32 `[tokens, N]`.

    x is rounded to bf16 (as a bf16 model's activations are); on AMX the products and sums are float32, on
    AVX-512 and AVX2 x is taken on an int16 grid per 16 inputs and the sums are integers (`native/avx512/tiles.h`; the
    bf16 flavour of AVX-512 multiplies x as it is).
    """
    require_input(packed, x)
    kernel = tiles.tile_kernel()  # one kernel for every pass on a machine
    require_layout(packed.layout, kernel.layout)
    return kernel.q6k_matmul(packed.tiles, packed.d, x, packed.out_features)


class BlockLinear(TileLinear):
    """`y = x W^T + b` with W a GGUF Q6_K matrix kept as its own bits in tiles (0.82 bytes a weight; bf16: 2)."""

    matmul = staticmethod(block_matmul)

    def __init__(self, raw: torch.Tensor, type_name: str, bias: torch.Tensor | None = None) -> None:
        if type_name not in BLOCK_BYTES:
            raise ValueError(f"no block kernel for {type_name}")
        super().__init__(pack_q6k(raw, tiles.tile_kernel().layout), bias)
