"""Weight-only int4 linears on our tile kernels (`kernels/tiles.tile_kernel`): AMX where the CPU grants it,
else AVX-512 VNNI, else AVX2, else PyTorch's CPU kernel (`_weight_int4pack_mm_for_cpu`).

Two ways in:
- `Int4Linear.from_affine`: a GGUF Q4_K, Q4_0 or Q4_1 matrix's own codes, scales and mins (exact up to
  the kernel's bf16 scale and offset), so the target computes what its file says; Q5_0, Q5_1 and Q5_K keep their
  5-bit codes (`bits=5`) where a tile kernel runs, and `SplitInt4Linear` splits Q8_0's codes (and 5-bit ones where
  only PyTorch's kernel runs) into two 4-bit halves;
- `Int4Linear.quantize`: re-quantizing a float weight (lossy), for drafts only. A lossy
  draft never changes what is emitted: verification uses what the draft sampled from.

A row is cut into groups of `group_size` input features; each group stores 4-bit codes
q in 0..15 with w = (q − 8) · scale + zero (PyTorch's layout; 5-bit: q in 0..31, w = (q − 16) · scale + zero).
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.kernels import tiles
from specdraft.kernels.int4_layout import AffineRows, affine_rows, fits, pack_rows

_INNER_K_TILES = 2
_PACK_ROWS = 8192  # a multiple of PyTorch's int4 packing's 64-row blocks (slices of 32 rows pack otherwise)

# PyTorch's kernel costs least per token at a few tokens per call and grows steeply past
# about 8 on 2 cores, so wider passes go through it in slices of this many tokens, or through
# the dense weight when one is kept. Our tile kernels take any width (8 or 16 tokens a pass).
PASS_WIDTH = 8


def five_bit_tiles_run(out_features: int, in_features: int, group_size: int = 32) -> bool:
    """Whether a matrix of this shape can run here on 5-bit tiles (`int4_layout`: a tile kernel runs here)."""
    return tiles.tile_kernel() is not None and fits(out_features, in_features, group_size)


def int4_kernel_available() -> bool:
    """Whether an int4 weight-only matmul runs here (one of ours, or this PyTorch build's CPU one)."""
    return tiles.tile_kernel() is not None or hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _minmax_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes `[N, K]` (uint8), scale and minimum `[N, K / G]` of min/max 4-bit groups, w ≈ scale · codes − minimum."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)  # [N, K/G, G]
    low, high = groups.amin(-1), groups.amax(-1)  # [N, K/G]
    scale = ((high - low) / 15).clamp_min(1e-8)
    codes = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8).view(n, k)
    return codes, scale, -low


class Int4Linear(nn.Module):
    """`y = x W^T + b` with W stored as packed 4-bit groups.

    With groups of 32 and N a multiple of 16, every pass runs on a tile kernel (`tile_matmul`):
    AMX (flat cost from 1 to 16 tokens), AVX-512 VNNI (each weight unpacked once per 8
    tokens) or AVX2 (once per 4). Otherwise PyTorch's kernel runs; `dense_weight`, when kept, then serves passes wider
    than `PASS_WIDTH` tokens (faster there, at the cost of its memory).
    """

    def __init__(
        self,
        rows: AffineRows,  # rows start:stop as codes [rows, K] in 0..15, scale and minimum [rows, K / G]
        out_features: int,  # N
        in_features: int,  # K
        group_size: int,  # G; w = scale · codes − minimum per group
        bias: torch.Tensor | None = None,  # [N]
        dense_weight: torch.Tensor | None = None,  # [N, K]
        bits: int = 4,  # 5: codes in 0..31, where a tile kernel runs (`five_bit_tiles_run`)
    ) -> None:
        super().__init__()
        n, k = self.out_features, self.in_features = out_features, in_features
        self.group_size = group_size
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.dense_weight = dense_weight
        kernel, self.tiles = tiles.tile_kernel(), None
        if bits != 4 and not five_bit_tiles_run(n, k, group_size):
            raise ValueError(f"5-bit codes need a tile kernel (AVX2 or more, not SPECDRAFT_ISA=torch) and a {n}x{k} matrix "
                             "their tiles fit (N % 16 == 0, K % 64 == 0, groups of 32)")
        if kernel is not None and fits(n, k, group_size):
            self.tiles = pack_rows(rows, n, k, group_size, kernel.layout, bits)
            self.tile_matmul = kernel.matmul
            for name in ("tiles", "scale", "zero"):  # buffers, so the module's memory shows them
                self.register_buffer(f"tile_{name}", getattr(self.tiles, name))
            return
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            raise SpecdraftError("This PyTorch build has no CPU int4 kernel; load the model unpacked.")
        packed, scales_and_zeros = [], []
        for start in range(0, n, _PACK_ROWS):  # in row slices: the int32 copy the packer needs stays small
            codes, scale, minimum = rows(start, min(start + _PACK_ROWS, n))
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(),
                                                                             _INNER_K_TILES))
            zero = 8 * scale.float() - minimum.float()  # (q − 8) · scale + zero = scale · q − minimum
            scales_and_zeros.append(torch.stack([scale.float(), zero], dim=-1))  # [rows, K/G, 2]
        self.register_buffer("packed", torch.cat(packed) if len(packed) > 1 else packed[0])
        self.register_buffer("scales_and_zeros", torch.cat(scales_and_zeros).transpose(0, 1).contiguous().to(torch.bfloat16))

    @classmethod
    def from_affine(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None = None, bits: int = 4) -> "Int4Linear":
        """From a file's own 4-bit (or 5-bit: `bits`) groups (e.g. Q4_K): `w = scale · codes − minimum` per group,
        codes `[N, K]`, scale and minimum `[N, K / G]`."""
        n, k = codes.shape
        return cls(affine_rows(codes, scale, minimum), n, k, k // scale.shape[1], bias, bits=bits)

    @classmethod
    def quantize(cls, linear: nn.Linear, group_size: int = 32, keep_dense: bool = False) -> "Int4Linear":
        """Re-quantize a float linear to min/max 4-bit groups (lossy; for drafts), a slice of rows at a time."""
        weight = linear.weight.detach()
        return cls(lambda start, stop: _minmax_groups(weight[start:stop], group_size), linear.out_features,
                   linear.in_features, group_size, linear.bias, weight if keep_dense else None)

    def num_packed_weights(self) -> int:
        """How many weights the packed matrix holds."""
        return 0 if self.dense_weight is not None else self.out_features * self.in_features

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this module computes with, `[N, K]` in float32 (for checks, not speed)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        columns = [self._kernel(eye[i:i + PASS_WIDTH]) for i in range(0, self.in_features, PASS_WIDTH)]
        return torch.cat(columns).float().t().contiguous()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, K] bf16 -> [tokens, N]
        if self.tiles is not None:
            return self.tile_matmul(self.tiles, x)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [tokens, K]
        if flat.shape[0] > PASS_WIDTH and self.dense_weight is not None:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return nn.functional.linear(x, self.dense_weight.to(x.dtype), bias)
        flat = flat.to(torch.bfloat16)
        if self.tiles is not None or flat.shape[0] <= PASS_WIDTH:
            out = self._kernel(flat)  # [tokens, N]; our kernels take any width, 8 or 16 tokens at a time
        else:
            out = torch.cat([self._kernel(flat[i:i + PASS_WIDTH]) for i in range(0, flat.shape[0], PASS_WIDTH)])
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features).to(x.dtype)


class SplitInt4Linear(nn.Module):
    """`y = x W^T + b` for W = W_high + W_low, two 4-bit matrices side by side in one `Int4Linear` `[N, 2K]`
    (`gguf_blocks.split_affine`: a 5- or 8-bit file's codes split into top bits and low nibble), run as
    `[x, x] · [W_high | W_low]ᵀ`: one kernel call, each token alone, 10 bits a weight (8 of codes, 2 of the halves' bf16 group scales and offsets)."""

    def __init__(self, halves: Int4Linear) -> None:
        super().__init__()
        self.halves = halves
        self.out_features, self.in_features = halves.out_features, halves.in_features // 2
        self.bias = halves.bias

    def num_packed_weights(self) -> int:
        """How many weights the matrix holds (each stored as two 4-bit halves)."""
        return self.out_features * self.in_features

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this module computes with, `[N, K]` in float32 (for checks, not speed)."""
        return self.halves.dequantized_weight().view(self.out_features, 2, self.in_features).sum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        return self.halves(torch.cat([x, x], dim=-1))  # [..., N]


def quantize_int4(model: nn.Module, group_size: int = 32, keep_dense: bool = False) -> int:
    """Swap every eligible `nn.Linear` of `model` (CPU) for a re-quantized `Int4Linear`; returns how many."""
    if not int4_kernel_available():
        raise SpecdraftError("This PyTorch build has no CPU int4 kernel; use --draft-quant none.")
    if next(model.parameters()).device.type != "cpu":
        raise SpecdraftError("--draft-quant int4 runs on the CPU kernel; use --draft-quant none on a GPU.")
    swaps = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.in_features % group_size == 0 and child.out_features % 16 == 0
    ]
    for parent, name in swaps:  # one at a time, so each float weight is freed as soon as it is replaced
        setattr(parent, name, Int4Linear.quantize(getattr(parent, name), group_size, keep_dense))
    return len(swaps)
