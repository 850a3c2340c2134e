"""Linears whose GGUF weights are Q4_0, multiplied as the file stores them (codes and an fp16 d per 32 weights:
w = d·(q − 8)) on the Q4_0 tiles of the AVX2 and AVX-512 libraries (each library's `q4k_tiles.h`, format
`TILES_Q4_0`: one layout, one function, the same bits): in an int8 pass (`prompt_pass`: on both levels every pass by
default) each token's activations on Q4_K's int8 scale per 256 inputs, per group the exact integer sum Σ q·â − 8·Σâ
and one float multiply-add; a sequence's first token, and every token where int8 activations are off,
against the file's exact weights (AVX2: the 16-bit tiles' int16 activations; AVX-512: in float32). The loader uses
them where the AVX2 or AVX-512 tile kernel runs (`available`) and K % 256 == 0; elsewhere (AMX, PyTorch's level,
Gemma's 1,152-wide rows) Q4_0 runs as 4-bit tiles with a bf16 scale and offset per 32 (`quantize.Int4Linear`).

Each token is computed alone, so a verify pass agrees bit for bit with one-token decoding; 4.5 bits a weight, the
file's own (the 4-bit tiles: 5, their scales rounded to bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from specdraft.kernels import tiles
from specdraft.kernels.int4_layout import quad_tiles
from specdraft.kernels.tile_linear import TileLinear, require_input

# (start, stop) -> rows start .. stop - 1 of a Q4_0 matrix as stored: codes [rows, K] (uint8 0..15) and d [rows, K/32]
# (float16): `gguf_blocks.q4_0_stored`
Q40Rows = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
TILE_ROWS, GROUP, ACTIVATION_BLOCK = 16, 32, 256  # K must hold whole blocks of Q4_K's int8 activations
_PACK_ROWS = 4096  # rows repacked at a time (a multiple of 16): the temporaries stay small


def available() -> bool:
    """Whether the loader puts Q4_0 linears on these kernels: where the AVX2 or the AVX-512 tile kernel runs (AMX
    keeps its bf16 tiles on 16-bit activations)."""
    return tiles.runs_stored_weights()


def fits(out_features: int, in_features: int) -> bool:
    """Whether a matrix of this shape has Q4_0 tiles: rows 16 to a tile, inputs in whole blocks of 256."""
    return out_features % TILE_ROWS == 0 and in_features % ACTIVATION_BLOCK == 0


@dataclass
class PackedQ40:
    """A Q4_0 matrix in tiles of 16 rows (`native/avx2/q4k_tiles.h`, both libraries' layout): `tiles [N/16 · K/32 ·
    256]` (the `QUADS` 4-bit tiles) and `steps [N/16, K/32, 16]` (int16: each row's d, as fp16 bits)."""

    tiles: torch.Tensor
    steps: torch.Tensor
    out_features: int
    in_features: int
    type_name: ClassVar[str] = "Q4_0"


def pack_q4_0(rows: Q40Rows, out_features: int, in_features: int) -> PackedQ40:
    """A Q4_0 matrix `[N, K]` (`fits`), read through `rows` `_PACK_ROWS` rows at a time, -> tiles, bit for bit."""
    if not fits(out_features, in_features):
        raise ValueError(f"Q4_0 tiles need N % 16 == 0 and K % 256 == 0; got [{out_features}, {in_features}]")
    blocks_total, groups = out_features // TILE_ROWS, in_features // GROUP
    codes_out = torch.empty((blocks_total, groups, 256), dtype=torch.uint8)
    steps_out = torch.empty((blocks_total, groups, TILE_ROWS), dtype=torch.int16)
    for start in range(0, out_features, _PACK_ROWS):
        codes, d = rows(start, min(start + _PACK_ROWS, out_features))  # [rows, K], [rows, K/32]
        blocks = codes.shape[0] // TILE_ROWS
        part = slice(start // TILE_ROWS, start // TILE_ROWS + blocks)
        codes_out[part] = quad_tiles(codes)
        steps_out[part] = d.view(torch.int16).reshape(blocks, TILE_ROWS, groups).permute(0, 2, 1)  # [nb, g, row]
    return PackedQ40(codes_out.view(-1), steps_out, out_features, in_features)


def q4_0_matmul(packed: PackedQ40, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for Q4_0 tiles; x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    require_input(packed, x)
    return tiles.tile_kernel().q4_0_matmul(packed.tiles, packed.steps, x, packed.out_features)


class Q40Linear(TileLinear):
    """`y = x W^T + b` with W a GGUF Q4_0 matrix kept as the file stores it."""

    matmul = staticmethod(q4_0_matmul)
    type_name = PackedQ40.type_name

    def __init__(self, rows: Q40Rows, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__(pack_q4_0(rows, out_features, in_features), bias)
