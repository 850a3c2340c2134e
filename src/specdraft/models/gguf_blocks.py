"""GGUF block formats read as tensors: the affine parts of the 4-bit types (Q4_K, Q4_0, Q4_1), and plain
dequantization.

Q4_K stores a row in super-blocks of 256 weights (144 bytes): an fp16 `d` and `dmin`,
twelve bytes holding eight 6-bit scales `sc` and eight 6-bit mins `m`, and 128 bytes of
4-bit codes. Each sub-block j of 32 weights is affine:

    w = (d · sc_j) · q − (dmin · m_j),   q in 0..15

which is exactly the form of PyTorch's int4 weight-only kernel with group size 32
(a scale and an offset per group). `q4k_affine` returns those parts without rounding, and
`q4_affine` those of Q4_0 (w = d · (q − 8): scale d, offset 8d) and Q4_1 (w = d · q + m: scale d,
offset −m), blocks of 32 whose 16 code bytes hold weights j (low nibble) and 16 + j (high).
`split_affine` reads the 5- and 8-bit types (and IQ4_NL / IQ4_XS, whose nibbles index 16 int8 values) as two 4-bit
affine halves, `five_bit_affine` the 5-bit ones as their own codes; other block types are dequantized by the `gguf`
library (the reference decoder).
"""

from __future__ import annotations

import numpy as np
import torch

from specdraft.gguf_layout import (IQ4_NL_BLOCK_BYTES, IQ4_VALUES, IQ4_XS_BLOCK_BYTES, Q4_0_BLOCK_BYTES,
                                   Q4_1_BLOCK_BYTES, Q4K_BLOCK_BYTES, Q4K_GROUP, Q5_0_BLOCK_BYTES, Q5_1_BLOCK_BYTES,
                                   Q5K_BLOCK_BYTES, Q6K_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK_K)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins `[..., 8]` (int32) of Q4_K's and Q5_K's twelve bytes `[..., 12]`."""
    packed = packed.to(torch.int32)
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # [..., 4] each
    # Sub-blocks 0-3 keep 6 bits in bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 put their low
    # 4 bits in bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-7.
    sc = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mn = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return sc, mn


def q4k_stored(raw: np.ndarray | torch.Tensor, type_name: str = "Q4_K") -> tuple[torch.Tensor, ...]:
    """A Q4_K or Q5_K matrix given as its raw bytes `[rows, blocks · 144 or 176]`, part by part as stored: `codes
    [rows, K]` (uint8: 0..15, Q5_K 0..31 with its fifth bits), `d` and `dmin [rows, K / 256]` (float16), the 6-bit
    `sc` and `m [rows, K / 32]` (uint8), with w = d·sc·q − dmin·m per group of 32, K = blocks · 256."""
    data = torch.as_tensor(np.asarray(raw)) if not isinstance(raw, torch.Tensor) else raw
    block_bytes = {"Q4_K": Q4K_BLOCK_BYTES, "Q5_K": Q5K_BLOCK_BYTES}.get(type_name)
    if block_bytes is None or data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % block_bytes:
        raise ValueError(f"Q4_K or Q5_K data must be uint8 [rows, blocks * {Q4K_BLOCK_BYTES} or {Q5K_BLOCK_BYTES}], "
                         f"got {type_name} {tuple(data.shape)} {data.dtype}")
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, block_bytes)  # [rows, nb, 144 or 176]
    nb = blocks.shape[1]
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(rows, nb)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).reshape(rows, nb)
    sc, mn = _k_scales_and_mins(blocks[..., 4:16])  # [rows, nb, 8] each
    qs = blocks[..., block_bytes - 128:].reshape(rows, nb, 4, 1, 32)  # [rows, nb, pair, 1, 32]
    # Each pair of sub-blocks shares 32 bytes: low nibbles are the first, high nibbles the second.
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, nb, 8, 32)  # [rows, nb, sub-block, 32]
    if type_name == "Q5_K":  # bit s of byte e of its 32 bytes is sub-block s's weight e's fifth bit
        codes = codes | (_bits(blocks[..., 16:48]).transpose(-1, -2) << 4)
    return (codes.reshape(rows, nb * QK_K), d, dmin, sc.reshape(rows, nb * 8).to(torch.uint8),
            mn.reshape(rows, nb * 8).to(torch.uint8))


def q4_0_stored(raw: torch.Tensor, type_name: str = "Q4_0") -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q5_0 matrix given as its raw bytes `[rows, blocks · 18 or 22]`, as stored: `codes [rows, K]` (uint8,
    0..15, Q5_0 0..31 with its fifth bits) and each group's `d [rows, K / 32]` (float16), w = d·(q − 8) or d·(q − 16)."""
    block_bytes = {"Q4_0": Q4_0_BLOCK_BYTES, "Q5_0": Q5_0_BLOCK_BYTES}.get(type_name)
    if block_bytes is None or raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"Q4_0 or Q5_0 data must be uint8 [rows, blocks * {Q4_0_BLOCK_BYTES} or {Q5_0_BLOCK_BYTES}], "
                         f"got {type_name} {tuple(raw.shape)} {raw.dtype}")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)  # [rows, nb, 18 or 22]
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)  # [rows, nb]
    qs = blocks[..., block_bytes - 16:].unsqueeze(2)  # [rows, nb, 1, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, -1, 32)  # [rows, nb, 32]: weights j, then 16 + j
    if type_name == "Q5_0":  # bit j of its little-endian 32-bit word is weight j's fifth bit
        codes = codes | (_bits(blocks[..., 2:6]).flatten(-2) << 4)
    return codes.reshape(rows, -1), d


def q4k_affine(raw: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and mins of a Q4_K matrix given as its raw bytes `[rows, blocks · 144]`.

    Returns `codes [rows, K]` (uint8, 0..15), `scale [rows, K / 32]` and `minimum [rows, K / 32]`
    (float32) with `w = scale · codes − minimum` per group of 32, K = blocks · 256.
    """
    codes, d, dmin, sc, mn = q4k_stored(raw)
    rows, nb = d.shape
    scale = (d.float()[..., None] * sc.view(rows, nb, 8).float()).reshape(rows, nb * 8)  # [rows, K / 32]
    minimum = (dmin.float()[..., None] * mn.view(rows, nb, 8).float()).reshape(rows, nb * 8)  # [rows, K / 32]
    return codes, scale, minimum


def _fp16(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


AFFINE_4BIT = ("Q4_K", "Q4_0", "Q4_1")  # the 4-bit block types with a scale and an offset per 32 weights
_Q4_BLOCK_BYTES = {"Q4_0": Q4_0_BLOCK_BYTES, "Q4_1": Q4_1_BLOCK_BYTES}


def q4_affine(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and mins (as `q4k_affine` returns them) of any 4-bit affine type in `AFFINE_4BIT`,
    given as raw bytes `[rows, bytes per row]` (uint8), exact (each part is an fp16 value or a product of one)."""
    if type_name == "Q4_K":
        return q4k_affine(raw)
    block_bytes = _Q4_BLOCK_BYTES[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"{type_name} data must be uint8 [rows, blocks * {block_bytes}], got {tuple(raw.shape)} {raw.dtype}")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)  # [rows, nb, 18 or 20]
    nb = blocks.shape[1]
    d = _fp16(blocks[..., 0:2])  # [rows, nb]
    minimum = 8 * d if type_name == "Q4_0" else -_fp16(blocks[..., 2:4])  # w = d · q − 8d, or d · q − (−m)
    qs = blocks[..., block_bytes - 16:].unsqueeze(2)  # [rows, nb, 1, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2)  # [rows, nb, 2, 16]: weights j, then 16 + j
    return codes.reshape(rows, nb * Q4K_GROUP), d, minimum


# types whose codes split into two 4-bit affine parts (IQ4_NL and IQ4_XS: the int8 values their nibbles stand for)
SPLIT_INTO_4BIT = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS")
_SPLIT_BLOCK_BYTES = {"Q8_0": Q8_0_BLOCK_BYTES, "Q5_0": Q5_0_BLOCK_BYTES, "Q5_1": Q5_1_BLOCK_BYTES,
                      "Q5_K": Q5K_BLOCK_BYTES, "IQ4_NL": IQ4_NL_BLOCK_BYTES, "IQ4_XS": IQ4_XS_BLOCK_BYTES}


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., n]` (uint8) as their bits `[..., n, 8]` (uint8 0 or 1), bit b of each byte at b."""
    return torch.from_numpy(np.unpackbits(packed.numpy()[..., None], axis=-1, bitorder="little"))


def signed_codes(blocks: torch.Tensor, type_name: str, stored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0, IQ4_NL or IQ4_XS blocks `[rows, nb, block bytes]` as each group's step `[rows, K / 32]` and its 32
    signed values `[rows, K / 32, 32]` (int16), w = step · value; `stored`: the codes as stored instead (uint8: Q8_0's
    int8 bytes, IQ4's indices into IQ4_VALUES)."""
    rows = blocks.shape[0]
    d = _fp16(blocks[..., 0:2])  # [rows, nb]
    if type_name == "Q8_0":
        codes = blocks[..., 2:].contiguous()
        return d, codes if stored else codes.view(torch.int8).to(torch.int16)
    qs = blocks[..., -QK_K // 2:] if type_name == "IQ4_XS" else blocks[..., 2:]  # [rows, nb, 128 or 16]
    qs = qs.reshape(rows, -1, 1, 16)  # [rows, groups, 1, 16]: a group's bytes
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, -1, 32)  # weights j, then 16 + j
    if not stored:
        q = torch.tensor(IQ4_VALUES, dtype=torch.int16)[q.long()]
    if type_name == "IQ4_NL":
        return d, q
    # IQ4_XS: sub-block i's 6-bit scale: bits 4i..4i+3 of the 4 low bytes, bits 2i, 2i+1 of the 16-bit high word
    high = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [rows, nb, 1]
    low = blocks[..., 4:8].unsqueeze(-1)  # [rows, nb, 4, 1]
    low = torch.cat([low & 0x0F, low >> 4], dim=-1).reshape(rows, -1, 8).to(torch.int32)  # [rows, nb, 8]
    scales = low | (((high >> (2 * torch.arange(8))) & 3) << 4)  # [rows, nb, 8] in 0..63
    return (d.unsqueeze(-1) * (scales - 32)).reshape(rows, -1), q


def stored_codes(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0, IQ4_NL or IQ4_XS rows (raw bytes `[rows, bytes per row]`) as each group's step `[rows, K / 32]` and its
    codes as stored `[rows, K / 32, 32]` (uint8: Q8_0's int8 bytes, IQ4's indices; `signed_codes`): what
    `int8_codes` packs."""
    block_bytes = _SPLIT_BLOCK_BYTES[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"{type_name} data must be uint8 [rows, blocks * {block_bytes}], got {tuple(raw.shape)} {raw.dtype}")
    step, codes = signed_codes(raw.reshape(raw.shape[0], -1, block_bytes), type_name, stored=True)
    return step.reshape(raw.shape[0], -1), codes.reshape(raw.shape[0], -1, 32)


def _code_parts(raw: torch.Tensor, type_name: str):
    """A 5- or 8-bit matrix's codes q = 16 h + l as their top bits h and low nibbles l `[rows, K / 32, 32]` (both
    0..15 after an offset), each group's step s and the minimums m_h, m_l `[rows, K / 32]` of w = s·q − m split as
    (16 s)·h − m_h + s·l − m_l."""
    block_bytes = _SPLIT_BLOCK_BYTES[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"{type_name} data must be uint8 [rows, blocks * {block_bytes}], got {tuple(raw.shape)} {raw.dtype}")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)  # [rows, nb, block bytes]
    nb = blocks.shape[1]
    if type_name in ("Q8_0", "IQ4_NL", "IQ4_XS"):  # w = step · q, q a signed 8-bit value
        step, q = signed_codes(blocks, type_name)  # [rows, groups], [rows, groups, 32] int16
        high, low = (q >> 4) + 8, q & 0x0F  # q = 16 (high − 8) + low
        high_min, low_min = 128 * step, torch.zeros_like(step)
    elif type_name in ("Q5_0", "Q5_1"):
        d = _fp16(blocks[..., 0:2])  # [rows, nb]
        bits_at = 2 if type_name == "Q5_0" else 4
        high = _bits(blocks[..., bits_at:bits_at + 4]).flatten(-2)  # [rows, nb, 32]: bit j of the little-endian word
        qs = blocks[..., bits_at + 4:].unsqueeze(2)  # [rows, nb, 1, 16]
        low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, nb, 32)  # weights j, then 16 + j
        high_min = 16 * d if type_name == "Q5_0" else -_fp16(blocks[..., 2:4])  # w = d·q − 16d, or d·q + m
        low_min, step = torch.zeros_like(d), d
    else:  # Q5_K: eight sub-blocks of 32 a super-block, w = d·sc·q − dmin·m
        d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [rows, nb]
        sc, mn = _k_scales_and_mins(blocks[..., 4:16])  # [rows, nb, 8]
        # bit s of byte e of the 32 is sub-block s's weight e
        high = _bits(blocks[..., 16:48]).transpose(-1, -2)  # [rows, nb, 8, 32]
        qs = blocks[..., 48:].reshape(rows, nb, 4, 1, 32)  # [rows, nb, pair, 1, 32]
        low = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, nb, 8, 32)  # sub-blocks 2p (low), 2p + 1 (high)
        step = (d.unsqueeze(-1) * sc).reshape(rows, nb * 8)  # [rows, K / 32]
        low_min = (dmin.unsqueeze(-1) * mn).reshape(rows, nb * 8)
        high_min = torch.zeros_like(low_min)
    groups = step.numel() // rows
    return (high.reshape(rows, groups, 32), low.reshape(rows, groups, 32), step.reshape(rows, groups),
            high_min.reshape(rows, groups), low_min.reshape(rows, groups))


def split_affine(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A matrix of 5- or 8-bit codes (`SPLIT_INTO_4BIT`, raw bytes `[rows, bytes per row]`) as two 4-bit affine
    matrices side by side, `W = W_high + W_low`: codes `[rows, 2K]` (high parts' columns first), scales and
    mins `[rows, 2K / 32]` as `q4k_affine` returns them, so `[x, x] · [W_high | W_low]ᵀ = x · Wᵀ`.

    A code q = 16 h + l (h the top bits, l the low nibble, both 0..15 after an offset) makes w = s · q − m into
    (16 s) · h − m and s · l: exact (each scale a product of an fp16 value and small integers)."""
    high, low, step, high_min, low_min = _code_parts(raw, type_name)
    rows = raw.shape[0]
    codes = torch.cat([high.reshape(rows, -1), low.reshape(rows, -1)], dim=1).to(torch.uint8)  # [rows, 2K]
    return codes, torch.cat([16 * step, step], dim=1), torch.cat([high_min, low_min], dim=1)  # [rows, 2K / 32]


FIVE_BIT = ("Q5_0", "Q5_1", "Q5_K")  # the types whose codes 5-bit tiles hold as they are (`five_bit_affine`)


def five_bit_affine(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q5_0, Q5_1 or Q5_K matrix (raw bytes `[rows, bytes per row]`) as its own 5-bit codes `[rows, K]` (0..31),
    scales and mins `[rows, K / 32]`, w = scale · codes − minimum: exact (as `split_affine`)."""
    if type_name not in FIVE_BIT:
        raise ValueError(f"5-bit codes are those of {', '.join(FIVE_BIT)}, not {type_name}")
    high, low, step, high_min, low_min = _code_parts(raw, type_name)
    codes = ((high << 4) | low).reshape(raw.shape[0], -1)  # [rows, K] uint8
    return codes, step, high_min + low_min


def q6k_unpack(raw: torch.Tensor) -> torch.Tensor:
    """A Q6_K matrix `[rows, blocks · 210]` (uint8) as float32 `[rows, blocks · 256]`.

    A super-block holds 128 bytes of low nibbles, 64 bytes of 2-bit high parts, sixteen
    int8 scales (one per 16 weights) and an fp16 `d`: w = d · scale_j · (q − 32), q in 0..63.
    """
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % Q6K_BLOCK_BYTES:
        raise ValueError(f"Q6_K data must be uint8 [rows, blocks * {Q6K_BLOCK_BYTES}], got {tuple(raw.shape)} {raw.dtype}")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q6K_BLOCK_BYTES)  # [rows, nb, 210]
    nb = blocks.shape[1]
    low = blocks[..., :128].reshape(rows, nb, 2, 1, 64)  # [rows, nb, half, 1, 64]
    low = torch.cat([low & 0x0F, low >> 4], dim=3).reshape(rows, nb, 8, 32)  # [rows, nb, 8, 32]
    high = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)  # [rows, nb, half, 1, 32]
    high = torch.cat([(high >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=3).reshape(rows, nb, 8, 32)
    q = (low | (high << 4)).to(torch.int16) - 32  # [rows, nb, 8, 32]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, nb, 16]
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    weights = q.view(rows, nb, 16, 16).float() * (d * scales).unsqueeze(-1)  # [rows, nb, 16, 16]
    return weights.view(rows, nb * QK_K)


_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def unpack_rows(raw: torch.Tensor, type_name: str, dim: int) -> torch.Tensor:
    """Rows of a GGUF matrix `[rows, bytes per row]` (uint8) as float32 `[rows, dim]`: the 4-bit affine
    types and Q6_K decoded here in torch, float types viewed, other block types through `gguf`."""
    if type_name in AFFINE_4BIT:
        codes, scale, minimum = q4_affine(raw, type_name)
        weights = codes.view(raw.shape[0], -1, Q4K_GROUP).float() * scale.unsqueeze(-1) - minimum.unsqueeze(-1)
        return weights.view(raw.shape[0], dim)  # from [rows, dim / 32, 32]
    if type_name == "Q6_K":
        return q6k_unpack(raw)
    if type_name in _FLOAT_TYPES:
        return raw.contiguous().view(_FLOAT_TYPES[type_name]).float().view(raw.shape[0], dim)
    return dequantize(raw.numpy(), type_name, (raw.shape[0], dim))


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's values as float32 `[*shape]` (numpy order, outermost first), via `gguf`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(np.asarray(raw), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
