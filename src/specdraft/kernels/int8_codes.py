"""Linears whose GGUF weights are int8 values times a step per 32, multiplied as the file stores them: Q8_0 (int8
codes, an fp16 step d: w = d·q) and IQ4_NL / IQ4_XS (4-bit indices into llama.cpp's 16 int8 values, a step d or
d·(scale − 32)), on the code tiles of the AVX2 and AVX-512 libraries (`native/avx2/int8_code_tiles.h`,
`native/avx512/int8_code_tiles.h`: one layout, one function, the same bits). The loader uses them where the AVX2 or
AVX-512 tile kernel runs (`available`), and splits these codes into two 4-bit halves on AMX
(`quantize.SplitInt4Linear`, 10 bits a weight).

The codes meet each token's activations on the 16-bit tiles' int16 grid, on every pass (no int8 pass), so a verify
pass agrees bit for bit with one-token decoding and the target runs its file's own weights: Q8_0 at the file's 8.5
bits a weight, IQ4 at 5 (the file's indices, a float32 step per 32: 4.25-4.5 in the file). On a 2-core Zen 3, a
16384 x 2048 Q8_0 matrix streamed from memory: one token 1.26 ms against the halves' 1.35 ms on int8 activations,
4 and 64 tokens as theirs (1.6 and 26 ms); the int8 activations' error (about 0.5%) is gone (1.5e-6 relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specdraft.kernels import tiles
from specdraft.kernels.tile_linear import TileLinear, require_input

TYPES = ("Q8_0", "IQ4_NL", "IQ4_XS")  # the GGUF types with code tiles here
# (start, stop) -> rows start .. stop - 1 as each group's step [rows, K/32] (float32) and its 32 codes as stored
# [rows, K/32, 32] (uint8: Q8_0's int8 bytes, IQ4's indices into its 16 values): `gguf_blocks.stored_codes` of a
# file's rows
CodeRows = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
TILE_ROWS, TILE_INPUTS = 8, 32
_PACK_ROWS = 16384  # rows repacked at a time (a multiple of 8): the temporaries stay small
# Input 8j + 4e + b (chunk j, pair b, e = 0 or 1) of a tile's row c: a Q8_0 tile's byte 64·j + 16·b + 2·c + e; an IQ4
# tile's byte 32·j + 16·(b // 2) + 2·c + e, in its low nibble for an even b, its high one for an odd b.


def available() -> bool:
    """Whether the loader puts Q8_0 and IQ4 linears on these kernels: where the AVX2 or AVX-512 tile kernel runs (AMX
    splits them into 4-bit halves for its bf16 tiles)."""
    return tiles.runs_stored_weights()


@dataclass
class PackedCodes:
    """A matrix of `type_name` in tiles of 8 rows x 32 inputs: `tiles [N/8 · K/32 · bytes]` (uint8: Q8_0's int8 codes
    (256 bytes a tile), IQ4's indices two to a byte (128)) and `steps [N/8, K/32, 8]` (Q8_0: its fp16 d as int16
    bits; IQ4: float32)."""

    tiles: torch.Tensor
    steps: torch.Tensor
    type_name: str
    out_features: int
    in_features: int


def pack_codes(rows: CodeRows, out_features: int, in_features: int, type_name: str) -> PackedCodes:
    """A `type_name` matrix `[N, K]` (N % 8 == 0, K % 32 == 0), read through `rows` `_PACK_ROWS` rows at a time (so no
    whole copy of it exists), -> tiles, without rounding."""
    if type_name not in TYPES:
        raise ValueError(f"no code tiles for {type_name}: they hold {', '.join(TYPES)}")
    row_block = 256 if type_name == "IQ4_XS" else TILE_INPUTS  # IQ4_XS keeps its scales per 256 weights
    if out_features % TILE_ROWS or in_features % row_block:
        raise ValueError(f"{type_name} tiles need N % 8 == 0 and K % {row_block} == 0; "
                         f"got [{out_features}, {in_features}]")
    groups = in_features // TILE_INPUTS
    q8_0 = type_name == "Q8_0"
    tiles_out = torch.empty((out_features // TILE_ROWS, groups, 256 if q8_0 else 128), dtype=torch.uint8)
    steps_out = torch.empty((out_features // TILE_ROWS, groups, TILE_ROWS), dtype=torch.int16 if q8_0 else torch.float32)
    for start in range(0, out_features, _PACK_ROWS):
        steps, codes = rows(start, min(start + _PACK_ROWS, out_features))  # [rows, groups], [rows, groups, 32] uint8
        blocks = steps.shape[0] // TILE_ROWS
        codes = codes.reshape(blocks, TILE_ROWS, groups, 4, 2, 4)  # [nb, c, g, j, e, b]: input 8j + 4e + b
        codes = codes.permute(0, 2, 3, 5, 1, 4).reshape(blocks, groups, 16, 16)  # [nb, g, (j, b), (c, e)]
        if not q8_0:  # pair steps (j, 2p) and (j, 2p + 1) share 16 bytes: low and high nibbles
            pairs = codes.view(blocks, groups, 4, 2, 2, 16)  # [nb, g, j, p, b % 2, (c, e)]
            codes = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
        block_slice = slice(start // TILE_ROWS, start // TILE_ROWS + blocks)
        tiles_out[block_slice] = codes.reshape(blocks, groups, -1)
        steps = steps.reshape(blocks, TILE_ROWS, groups).permute(0, 2, 1)  # [nb, g, c]
        steps_out[block_slice] = steps.half().view(torch.int16) if q8_0 else steps
    return PackedCodes(tiles_out.view(-1), steps_out, type_name, out_features, in_features)


def code_matmul(packed: PackedCodes, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for code tiles; x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    require_input(packed, x)
    return tiles.tile_kernel().code_matmul(packed.tiles, packed.steps, packed.type_name, x, packed.out_features)


class CodeLinear(TileLinear):
    """`y = x W^T + b` with W a GGUF Q8_0, IQ4_NL or IQ4_XS matrix kept as the file's codes and steps."""

    matmul = staticmethod(code_matmul)

    def __init__(self, rows: CodeRows, out_features: int, in_features: int, type_name: str,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(pack_codes(rows, out_features, in_features, type_name), bias)
