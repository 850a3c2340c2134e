"""Weight-only int4 linears for a cheaper draft (PyTorch's CPU int4 kernel).

Quantizing the draft changes only what it proposes, never what is emitted: verification
uses the distribution the draft actually sampled from (`q_draft`), so a lossy draft stays
exact. The target is never quantized here.

Each row of a weight is cut into groups of `group_size` input features; a group stores
4-bit codes q in 0..15 with an affine map w ≈ (q - 8) · scale + zero (PyTorch's layout).
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.errors import SpecdraftError

_INNER_K_TILES = 2


def int4_kernel_available() -> bool:
    """Whether this PyTorch build has the CPU int4 weight-only matmul."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


# Passes wider than this many tokens (a prefill) use the dense weight: the int4 kernel's cost
# grows steeply with tokens on CPU, while a wide bf16 matmul is compute-bound and efficient.
DENSE_ABOVE_TOKENS = 16


class Int4Linear(nn.Module):
    """`y = x W^T + b` with W stored as packed 4-bit groups (CPU kernel) for narrow passes.

    The dense weight is kept for wide passes (prefill), where the int4 kernel is slow; both
    paths compute the draft's proposal distribution, and verification is exact either way.
    """

    def __init__(self, linear: nn.Linear, group_size: int = 32) -> None:
        super().__init__()
        self.dense_weight = linear.weight  # [N, K], shared, not copied
        weight = linear.weight.detach().float()  # [N, K]
        n, k = weight.shape
        self.in_features, self.out_features, self.group_size = k, n, group_size
        groups = weight.view(n, k // group_size, group_size)  # [N, K/G, G]
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(1e-8)  # [N, K/G, 1]
        codes = ((groups - low) / scale).round().clamp(0, 15).view(n, k).to(torch.int32)  # [N, K]
        zero = low + 8 * scale
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES))
        scales_and_zeros = torch.stack([scale.view(n, -1), zero.view(n, -1)], dim=-1)  # [N, K/G, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        shape = x.shape
        if x.numel() // shape[-1] > DENSE_ABOVE_TOKENS:
            return nn.functional.linear(x, self.dense_weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
        )  # [tokens, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features).to(x.dtype)


def quantize_int4(model: nn.Module, group_size: int = 32) -> int:
    """Swap every eligible `nn.Linear` of `model` (CPU, bf16) for an `Int4Linear`; returns how many."""
    if not int4_kernel_available():
        raise SpecdraftError("This PyTorch build has no CPU int4 kernel; use --draft-quant none.")
    if next(model.parameters()).device.type != "cpu":
        raise SpecdraftError("--draft-quant int4 runs on the CPU kernel; use --draft-quant none on a GPU.")
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.in_features % group_size == 0 and child.out_features % 8 == 0
    ]
    for parent, name, child in swaps:
        setattr(parent, name, Int4Linear(child, group_size))
    return len(swaps)
