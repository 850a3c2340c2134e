"""The module shape every linear over a packed GGUF matrix shares (`gguf_matmul.BlockLinear`,
`dense_matmul.DenseLinear`, `int8_codes.CodeLinear`, `q4k_tiles.Q4KLinear`,
`q4k_tiles.Q40Linear`): the packed matrix, its float32 bias, and a
forward that multiplies on the tile kernels, its packed tensors as buffers (`tiles`, `tile_<field>`); and the input
check every packed matmul makes (`require_input`)."""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import nn


def require_input(packed, x: torch.Tensor) -> None:
    """A ValueError unless x is `[tokens, K]` for the packed matrix (`packed.in_features` inputs)."""
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be [tokens, {packed.in_features}], got {tuple(x.shape)}")


def packed_tensors(packed) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a packed matrix (a dataclass: `tiles` and its scales or steps), by field name."""
    return [(field.name, getattr(packed, field.name)) for field in fields(packed)
            if isinstance(getattr(packed, field.name), torch.Tensor)]


class TileLinear(nn.Module):
    """`y = x W^T + b` with W packed for the tile kernels. A subclass sets `packed` (with `out_features` and
    `in_features`) and names its kernel `matmul(packed, x [tokens, K]) -> float32 [tokens, N]`."""

    matmul = None  # the subclass's kernel, a staticmethod

    def __init__(self, packed, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = packed
        for name, tensor in packed_tensors(packed):  # buffers, so the module's memory shows them
            self.register_buffer(name if name == "tiles" else f"tile_{name}", tensor)
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def type_name(self) -> str:
        """The GGUF type its tiles hold (the packed matrix's)."""
        return self.packed.type_name

    def num_packed_weights(self) -> int:
        """How many weights the packed matrix holds."""
        return self.out_features * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        out = self.matmul(self.packed, x.reshape(-1, self.in_features))  # [tokens, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
