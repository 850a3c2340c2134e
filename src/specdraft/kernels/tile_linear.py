"""The module shape every linear over a packed GGUF matrix shares (`gguf_matmul.BlockLinear`,
`dense_matmul.DenseLinear`): the packed matrix, its float32 bias, and a forward that multiplies on the tile kernels."""

from __future__ import annotations

import torch
from torch import nn


class TileLinear(nn.Module):
    """`y = x W^T + b` with W packed for the tile kernels. A subclass sets `packed` (with `out_features` and
    `in_features`) and names its kernel `matmul(packed, x [tokens, K]) -> float32 [tokens, N]`."""

    matmul = None  # the subclass's kernel, a staticmethod

    def __init__(self, packed, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = packed
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def num_packed_weights(self) -> int:
        """How many weights the packed matrix holds."""
        return self.out_features * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        out = self.matmul(self.packed, x.reshape(-1, self.in_features))  # [tokens, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
