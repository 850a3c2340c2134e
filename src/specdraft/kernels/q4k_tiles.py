"""Linears whose GGUF weights are Q4_K or Q5_K, multiplied as the file stores them (codes, 6-bit scales and mins, fp16 d
and dmin per 256 weights) on the Q4_K tiles of the AVX2 and AVX-512 libraries (`native/avx2/q4k_tiles.h`,
`native/avx512/q4k_tiles.h`: one layout, one function, the same bits): in an int8 pass (`prompt_pass`: on both
levels every pass by default) llama.cpp's numerics, each token's activations on one int8 scale per 256 inputs and the
scales applied as integers, one float multiply-add per 256 weights; a sequence's first token, and every token where
int8 activations are off, against the file's exact weights (AVX2: the 16-bit tiles' int16 activations; AVX-512: in
float32). The loader uses them where the AVX2 or AVX-512 tile kernel runs (`available`); on AMX and PyTorch's
level Q4_K runs as 4-bit tiles with a bf16 scale and offset per 32 (`quantize.Int4Linear`).

Each token is computed alone, so a verify pass agrees bit for bit with one-token decoding; 4.625 bits a weight (the
file: 4.5; the 4-bit tiles: 5). Against the 4-bit tiles' int8 passes (8192 x 3072 in cache, 2 cores, Zen 3): one
token 1.25x faster, 2-128 tokens 1.13-1.17x. Q5_K is the same function on 5-bit codes: its tiles hold the 4-bit
tiles' nibbles and then the fifth bits as the AVX2 5-bit tiles place them (`int4_layout.code_tiles`, `QUADS`), 5.625
bits a weight (the file: 5.5; the 5-bit tiles: 6, their scales rounded to bf16).

Q4_0 and Q5_0 (4- or 5-bit codes and an fp16 d per 32 weights: w = d·(q − 8) or d·(q − 16)) run on the same tiles with
each group's d (`PackedQ40`, `Q40Linear`; the libraries' formats `TILES_Q4_0`, `TILES_Q5_0`): each token's
activations on one int8 scale per 32 inputs (llama.cpp's Q8_0), per group the exact integer sum Σ q·â − 2^(bits−1)·Σâ
and one float multiply-add; the first token, and every token out of an int8 pass, against the exact weights. 4.5 and
5.5 bits a weight, the file's own (the 4- and 5-bit tiles: 5 and 6, their scales rounded to bf16); any row width of
whole groups (Gemma's 1,152-wide Q5_0 rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specdraft.kernels import tiles
from specdraft.kernels.int4_layout import QUADS, TILE_BYTES, code_tiles
from specdraft.kernels.tile_linear import TileLinear, require_input

# (start, stop) -> rows start .. stop - 1 of a Q4_K or Q5_K matrix as stored: codes [rows, K] (uint8 0..15 or 0..31),
# d and dmin [rows, K/256] (float16), sc and m [rows, K/32] (uint8): `gguf_blocks.q4k_stored`
Q4KRows = Callable[[int, int], tuple[torch.Tensor, ...]]
TILE_ROWS, SUPER = 16, 256
BITS = {"Q4_K": 4, "Q5_K": 5}  # the K-quants these tiles hold, by code width
GROUP_BITS = {"Q4_0": 4, "Q5_0": 5}  # the types they hold with a step per group of 32 (`Q40Linear`)
GROUP = 32
_PACK_ROWS = 4096  # rows repacked at a time (a multiple of 16): the temporaries stay small


def available() -> bool:
    """Whether the loader puts Q4_K, Q5_K, Q4_0 and Q5_0 linears on these kernels: where the AVX2 or the AVX-512 tile
    kernel runs (AMX keeps its bf16 tiles on 16-bit activations)."""
    return tiles.runs_stored_weights()


@dataclass
class PackedQ4K:
    """A Q4_K (or Q5_K: `bits` 5) matrix in tiles of 16 rows (`native/avx2/q4k_tiles.h`, both libraries' layout):
    `tiles [N/16 · K/32 · 256 or 320]` (the `QUADS` 4- or 5-bit tiles), `marks [N/16, K/256, 256]` (uint8: each
    super-block's 6-bit scales, then its mins) and `steps [N/16, K/256, 32]` (int16: d, then dmin, as fp16 bits)."""

    tiles: torch.Tensor
    marks: torch.Tensor
    steps: torch.Tensor
    out_features: int
    in_features: int
    bits: int = 4

    @property
    def type_name(self) -> str:
        return "Q5_K" if self.bits == 5 else "Q4_K"


def pack_q4k(rows: Q4KRows, out_features: int, in_features: int, type_name: str = "Q4_K") -> PackedQ4K:
    """A Q4_K or Q5_K matrix `[N, K]` (N % 16 == 0, K % 256 == 0), read through `rows` `_PACK_ROWS` rows at a time,
    -> tiles, bit for bit (nothing rounded)."""
    if out_features % TILE_ROWS or in_features % SUPER:
        raise ValueError(f"{type_name} tiles need N % 16 == 0 and K % 256 == 0; got [{out_features}, {in_features}]")
    bits = BITS[type_name]
    blocks_total, supers = out_features // TILE_ROWS, in_features // SUPER
    codes_out = torch.empty((blocks_total, in_features // GROUP, TILE_BYTES[bits]), dtype=torch.uint8)
    marks_out = torch.empty((blocks_total, supers, 256), dtype=torch.uint8)
    steps_out = torch.empty((blocks_total, supers, 32), dtype=torch.int16)
    for start in range(0, out_features, _PACK_ROWS):
        codes, d, dmin, sc, mn = rows(start, min(start + _PACK_ROWS, out_features))
        blocks = codes.shape[0] // TILE_ROWS
        part = slice(start // TILE_ROWS, start // TILE_ROWS + blocks)
        codes_out[part] = code_tiles(codes, QUADS, bits)
        scales = sc.reshape(blocks, TILE_ROWS, supers, 8).permute(0, 2, 3, 1)  # [nb, s, group, row]
        mins = mn.reshape(blocks, 2, 8, supers, 4, 2).permute(0, 3, 4, 1, 2, 5)  # [nb, s, pair, half, row, e]
        marks_out[part] = torch.cat([scales.reshape(blocks, supers, 128), mins.reshape(blocks, supers, 128)], dim=-1)
        steps = torch.stack([d, dmin], dim=1).view(torch.int16)  # [rows, 2, s]
        steps_out[part] = steps.reshape(blocks, TILE_ROWS, 2, supers).permute(0, 3, 2, 1).reshape(blocks, supers, 32)
    return PackedQ4K(codes_out.view(-1), marks_out, steps_out, out_features, in_features, bits)


def q4k_matmul(packed: PackedQ4K, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for Q4_K or Q5_K tiles; x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    require_input(packed, x)
    return tiles.tile_kernel().q4k_matmul(packed.tiles, packed.marks, packed.steps, x, packed.out_features,
                                          packed.bits)


class Q4KLinear(TileLinear):
    """`y = x W^T + b` with W a GGUF Q4_K or Q5_K matrix (`type_name`) kept as the file stores it."""

    matmul = staticmethod(q4k_matmul)

    def __init__(self, rows: Q4KRows, out_features: int, in_features: int, bias: torch.Tensor | None = None,
                 type_name: str = "Q4_K") -> None:
        super().__init__(pack_q4k(rows, out_features, in_features, type_name), bias)


# (start, stop) -> rows start .. stop - 1 of a Q4_0 or Q5_0 matrix as stored: codes [rows, K] (uint8 0..15 or 0..31)
# and d [rows, K/32] (float16): `gguf_blocks.q4_0_stored`
Q40Rows = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PackedQ40:
    """A Q4_0 (or Q5_0: `bits` 5) matrix in tiles of 16 rows (`native/avx2/q4k_tiles.h`, both libraries' layout):
    `tiles [N/16 · K/32 · 256 or 320]` (the `QUADS` 4- or 5-bit tiles) and `steps [N/16, K/32, 16]` (int16: each
    row's d, as fp16 bits)."""

    tiles: torch.Tensor
    steps: torch.Tensor
    out_features: int
    in_features: int
    bits: int = 4

    @property
    def type_name(self) -> str:
        return "Q5_0" if self.bits == 5 else "Q4_0"


def pack_q4_0(rows: Q40Rows, out_features: int, in_features: int, type_name: str = "Q4_0") -> PackedQ40:
    """A Q4_0 or Q5_0 matrix `[N, K]` (N % 16 == 0, K % 32 == 0), read through `rows` `_PACK_ROWS` rows at a time, ->
    tiles, bit for bit."""
    if out_features % TILE_ROWS or in_features % GROUP:
        raise ValueError(f"{type_name} tiles need N % 16 == 0 and K % 32 == 0; got [{out_features}, {in_features}]")
    bits = GROUP_BITS[type_name]
    blocks_total, groups = out_features // TILE_ROWS, in_features // GROUP
    codes_out = torch.empty((blocks_total, groups, TILE_BYTES[bits]), dtype=torch.uint8)
    steps_out = torch.empty((blocks_total, groups, TILE_ROWS), dtype=torch.int16)
    for start in range(0, out_features, _PACK_ROWS):
        codes, d = rows(start, min(start + _PACK_ROWS, out_features))  # [rows, K], [rows, K/32]
        blocks = codes.shape[0] // TILE_ROWS
        part = slice(start // TILE_ROWS, start // TILE_ROWS + blocks)
        codes_out[part] = code_tiles(codes, QUADS, bits)
        steps_out[part] = d.view(torch.int16).reshape(blocks, TILE_ROWS, groups).permute(0, 2, 1)  # [nb, g, row]
    return PackedQ40(codes_out.view(-1), steps_out, out_features, in_features, bits)


def q4_0_matmul(packed: PackedQ40, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for Q4_0 or Q5_0 tiles; x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    require_input(packed, x)
    return tiles.tile_kernel().q4_0_matmul(packed.tiles, packed.steps, x, packed.out_features, packed.bits)


class Q40Linear(TileLinear):
    """`y = x W^T + b` with W a GGUF Q4_0 or Q5_0 matrix (`type_name`) kept as the file stores it."""

    matmul = staticmethod(q4_0_matmul)

    def __init__(self, rows: Q40Rows, out_features: int, in_features: int, bias: torch.Tensor | None = None,
                 type_name: str = "Q4_0") -> None:
        super().__init__(pack_q4_0(rows, out_features, in_features, type_name), bias)
