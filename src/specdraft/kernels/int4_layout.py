"""The packed 4-bit layouts of the tile kernels: `PAIRS` (the AVX-512 library's `tiles.h`,
`int8_tiles.h` and `amx_tiles.h`) and `QUADS` (the AVX2 library's `tiles.h` and `int8_tiles.h`). Both hold 256 bytes for each block of 16 output rows and group g of
32 inputs, two codes a byte, low nibble first:

- `PAIRS`: the code pair (q[n0 + c][k0 + 2r], q[n0 + c][k0 + 2r + 1]) is the byte at
  64·(r / 4) + 16·(c / 4) + 4·(r % 4) + c % 4, so that two rounds of byte unpacking turn each 64 bytes into four
  vectors of 16 code pairs (as bf16 128 + q: AMX's pair-interleaved B tile rows; as int16 q: the operand of
  AVX-512's `vpdpwssd`).
- `QUADS`: the codes (q[n0 + 8h + c][k0 + 8j + b], q[n0 + 8h + c][k0 + 8j + 4 + b]) are the byte at
  64·j + 32·h + 4·c + b (c < 8, b < 4), so that a mask and a shift turn each 32 bytes into the two operands of
  `vpmaddubsw` for 8 rows (dword c: four consecutive inputs of row c), with no byte shuffle.

Scales s and offsets z = 8s − m: bf16 [N/16][K/32][16], with w = s·(q − 8) + z. The integer sums the kernels
take are exact whatever the order of their terms, so both layouts give the same bits.

5-bit tiles (`bits` 5: Q5_0, Q5_1 and Q5_K as stored, `TileKernel.int5`) are 320 bytes: a 4-bit tile of the codes'
low nibbles, then 64 bytes of their fifth bits, placed for the layout's unpacking:

- `PAIRS`: for each 64 nibble bytes two little-endian 64-bit masks, bit m of mask v the fifth bit of byte m of the
  pair vector v that unpacking those 64 bytes makes (`native/avx512/tile_unpack.h`: byte m = 16·L + 2u + e of vector
  v of chunk c holds row 4·L + u % 4, input 8·c + 4·v + 2·(u // 4) + e; a masked byte add puts it in place);
- `QUADS`: for chunks 2p and 2p + 1 (64 nibble bytes each) 32 bytes, bit 4·(j % 2) + 2h + e of byte i the fifth
  bit of nibble e of byte 64·j + 32·h + i (a shift and a mask put it in place, as Q6_K's top bits).

Offsets are z = 16s − m, with w = s·(q − 16) + z: 6 bits a weight with the scales, where two 4-bit halves took 10.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specdraft.kernels.tile_linear import require_input

PAIRS, QUADS = "pairs", "quads"  # the layouts (module doc)
GROUP = 32  # inputs per scale and minimum
BLOCK_ROWS = 16  # outputs per tile
_PACK_ROWS = 4096  # rows packed at a time (a multiple of BLOCK_ROWS)
TILE_BYTES = {4: 256, 5: 320}  # bytes of a tile of 16 rows x 32 inputs, by code width


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a matrix of this shape and group size can be packed for the kernel."""
    return group_size == GROUP and out_features % BLOCK_ROWS == 0 and in_features % (2 * GROUP) == 0


@dataclass
class PackedInt4:
    """A matrix in a kernel's layout: tile bytes `[N/16 · K/32 · TILE_BYTES[bits]]` (uint8) laid out as `layout` says,
    scale and zero `[N/16, K/32, 16]` (bf16) with w = scale · (q − 2^(bits−1)) + zero (zero = 2^(bits−1) · scale −
    minimum)."""

    tiles: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    out_features: int
    in_features: int
    layout: str = PAIRS
    bits: int = 4


def nibble_tiles(codes: torch.Tensor) -> torch.Tensor:
    """Codes `[rows, K]` (0..15, rows % 16 == 0) as `PAIRS` tile bytes `[rows / 16, K / 32, 256]` (module doc)."""
    rows, k = codes.shape
    blocks, groups = rows // BLOCK_ROWS, k // GROUP
    # codes[n0 + c, k0 + 2r + e] -> a byte of tile (nb, g), low nibble e = 0, high nibble e = 1,
    # at 64·(r / 4) + 16·(c / 4) + 4·(r % 4) + c % 4
    pairs = codes.to(torch.uint8).view(blocks, BLOCK_ROWS, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    nibbles = pairs[..., 0] | (pairs[..., 1] << 4)  # [blocks, K/32, r = 16, c = 16]
    return nibbles.view(blocks, groups, 4, 4, 4, 4).permute(0, 1, 2, 4, 3, 5).reshape(blocks, groups, 256)


def byte_words(values: torch.Tensor, *shape: int) -> torch.Tensor:
    """Byte values `[rows, K]` (K % 4 == 0) four to an int32 word (inputs 4i .. 4i + 3, one a byte, the first lowest:
    x86 and ARM are little-endian), viewed as `shape`: the QUADS layouts move whole words, and shift and or four
    bytes in one operation where no byte carries into the next (2.6-5x faster than a byte at a time, 4096 x 2048)."""
    values = values.to(torch.uint8).contiguous()
    if values.storage_offset() % 4:  # a view starting inside a word: copied, as words must start on one
        values = values.clone()
    return values.view(torch.int32).view(*shape)


def quad_tiles(codes: torch.Tensor) -> torch.Tensor:
    """Codes `[rows, K]` (0..15, rows % 16 == 0) as `QUADS` tile bytes `[rows / 16, K / 32, 256]` (module doc)."""
    rows, k = codes.shape
    blocks, groups = rows // BLOCK_ROWS, k // GROUP
    # codes[n0 + 8h + c, k0 + 8j + 4e + b] -> nibble e of byte 64·j + 32·h + 4·c + b of tile (nb, g): the word of
    # inputs 8j .. 8j + 3 of row 8h + c, or'ed with the next word's shifted by a nibble (codes < 16: no carry)
    words = byte_words(codes, blocks, 2, 8, groups, 4, 2)  # [nb, h, c, g, j, e]
    nibbles = words[..., 0] | (words[..., 1] << 4)  # [nb, h, c, g, j]
    return nibbles.permute(0, 3, 4, 1, 2).contiguous().view(torch.uint8).view(blocks, groups, 256)


_TILE_BYTES = {PAIRS: nibble_tiles, QUADS: quad_tiles}


def tile_bytes(layout: str):
    """The function that lays out codes as tile bytes in `layout` (`nibble_tiles`, `quad_tiles`); a ValueError naming
    the layouts for any other."""
    if layout not in _TILE_BYTES:
        raise ValueError(f"unknown 4-bit tile layout {layout!r}; one of {sorted(_TILE_BYTES)}")
    return _TILE_BYTES[layout]


def require_layout(packed: str, kernel: str) -> None:
    """A ValueError where a matrix packed in layout `packed` is given to a kernel that reads `kernel`."""
    if packed != kernel:
        raise ValueError(f"this kernel reads {kernel} tiles; the matrix was packed as {packed} "
                         f"(pack it with the kernel's layout)")


AffineRows = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""Rows `start:stop` of a 4-bit affine matrix as codes `[rows, K]` (0..15), scale and minimum `[rows, K/32]`,
w = scale · codes − minimum: made a slice at a time, so no whole copy of a big matrix's codes need exist."""


def affine_rows(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> AffineRows:
    """Whole codes, scale and minimum as `AffineRows`."""
    return lambda start, stop: (codes[start:stop], scale[start:stop], minimum[start:stop])


def pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, layout: str = PAIRS) -> PackedInt4:
    """From codes `[N, K]` in 0..15 and scale, minimum `[N, K/32]`, tiles in `layout` (`PAIRS`, `QUADS`: module doc)."""
    return pack_rows(affine_rows(codes, scale, minimum), *codes.shape, codes.shape[1] // scale.shape[1], layout)


def _fifth_bit_masks(high: torch.Tensor) -> torch.Tensor:
    """Fifth bits `[rows, K]` (0 or 1, rows % 16 == 0) as a `PAIRS` 5-bit tile's mask bytes `[rows / 16, K / 32, 64]`
    (module doc): bit 2·(u % 4) + e of byte 16·chunk + 8·vector + 2·L + u // 4 is the fifth bit of row 4·L + u % 4,
    input 8·chunk + 4·vector + 2·(u // 4) + e; each row's two bits of a byte first, then its four rows'."""
    rows, k = high.shape
    bits = high.to(torch.uint8).view(rows // BLOCK_ROWS, 4, 4, k // GROUP, 4, 2, 2, 2)  # [nb, L, u%4, g, c, v, u//4, e]
    pairs = bits[..., 0] | (bits[..., 1] << 1)  # [nb, L, u%4, g, chunk, v, u//4]
    masks = pairs[:, :, 0] | (pairs[:, :, 1] << 2) | (pairs[:, :, 2] << 4) | (pairs[:, :, 3] << 6)  # [nb, L, g, ..]
    return masks.permute(0, 2, 3, 4, 1, 5).reshape(rows // BLOCK_ROWS, k // GROUP, 64)  # [nb, g, chunk, v, L, u//4]


def _fifth_bit_quads(high: torch.Tensor) -> torch.Tensor:
    """Fifth bits `[rows, K]` (0 or 1, rows % 16 == 0) as a `QUADS` 5-bit tile's last bytes `[rows / 16, K / 32, 64]`
    (module doc)."""
    rows, k = high.shape
    # high[n0 + 8h + c, k0 + 16p + 8(j % 2) + 4e + b] -> bit 4·(j % 2) + 2h + e of byte 32p + 4c + b: each row's
    # bits of a byte first (j % 2 and e), then the two rows' (h) together, a word of four bytes (b) at a time
    words = byte_words(high, rows, k // GROUP, 2, 2, 2)  # [row, g, p, j % 2, e]
    row_bits = words[..., 0, 0] | (words[..., 0, 1] << 1) | (words[..., 1, 0] << 4) | (words[..., 1, 1] << 5)
    halves = row_bits.view(rows // BLOCK_ROWS, 2, 8, k // GROUP, 2)  # [nb, h, c, g, p]
    tiles = halves[:, 0] | (halves[:, 1] << 2)  # [nb, c, g, p]
    return tiles.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(rows // BLOCK_ROWS, k // GROUP, 64)


_FIFTH_BITS = {PAIRS: _fifth_bit_masks, QUADS: _fifth_bit_quads}


def code_tiles(codes: torch.Tensor, layout: str, bits: int = 4) -> torch.Tensor:
    """Codes `[rows, K]` (0..2^bits − 1, rows % 16 == 0) as `layout`'s tile bytes `[rows / 16, K / 32, TILE_BYTES[bits]]`:
    the low nibbles' tile, then (5 bits) the fifth bits placed for the layout's unpacking (module doc)."""
    if bits not in TILE_BYTES:
        raise ValueError(f"tiles hold 4- or 5-bit codes, not {bits}-bit ones")
    nibbles = tile_bytes(layout)(codes & 0x0F).view(codes.shape[0] // BLOCK_ROWS, codes.shape[1] // GROUP, 256)
    return nibbles if bits == 4 else torch.cat([nibbles, _FIFTH_BITS[layout](codes >> 4)], dim=-1)


def pack_rows(rows: AffineRows, n: int, k: int, group_size: int, layout: str = PAIRS, bits: int = 4) -> PackedInt4:
    """An `[n, k]` matrix in groups of `group_size`, asked of `rows` a slice at a time, as tiles in `layout` of
    `bits`-bit codes (4 or 5: module doc)."""
    tile_bytes(layout)  # an unknown layout is refused before any work
    if not fits(n, k, group_size):
        raise ValueError(f"int4 tile packing needs N % 16 == 0, K % 64 == 0 and groups of 32; got {n}x{k}")
    if bits not in TILE_BYTES:
        raise ValueError(f"tiles hold 4- or 5-bit codes, not {bits}-bit ones")
    blocks, groups = n // BLOCK_ROWS, k // GROUP
    tile_width = TILE_BYTES[bits]
    tiles = torch.empty((blocks, groups, tile_width), dtype=torch.uint8)
    tile_scale = torch.empty((blocks, groups, BLOCK_ROWS), dtype=torch.bfloat16)
    tile_zero = torch.empty_like(tile_scale)
    for start in range(0, n, _PACK_ROWS):  # in row slices: the temporaries stay small (a draft's LM head is 136M weights)
        stop = min(start + _PACK_ROWS, n)
        codes, scale, minimum = rows(start, stop)
        part_blocks = (stop - start) // BLOCK_ROWS
        block_range = slice(start // BLOCK_ROWS, stop // BLOCK_ROWS)
        tiles[block_range] = code_tiles(codes, layout, bits)
        scale = scale.float()
        tile_scale[block_range] = scale.view(part_blocks, BLOCK_ROWS, groups).permute(0, 2, 1)
        middle = 1 << (bits - 1)
        tile_zero[block_range] = (middle * scale - minimum.float()).view(part_blocks, BLOCK_ROWS, groups).permute(0, 2, 1)
    return PackedInt4(tiles.view(-1), tile_scale, tile_zero, n, k, layout, bits)


def run_tile_kernel(kernel, packed: PackedInt4, x: torch.Tensor, layout: str) -> torch.Tensor:
    """Call a compiled `kernel(tiles, scale, zero, x, y, N, K, tokens)` that reads tiles in `layout` for
    `x @ W^T`: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    require_layout(packed.layout, layout)
    x = x.to(torch.bfloat16).contiguous()
    require_input(packed, x)
    out = torch.empty((x.shape[0], packed.out_features), dtype=torch.float32)
    kernel(packed.tiles.data_ptr(), packed.scale.data_ptr(), packed.zero.data_ptr(), x.data_ptr(), out.data_ptr(),
           packed.out_features, packed.in_features, x.shape[0])
    return out
