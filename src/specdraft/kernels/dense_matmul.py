"""Linears that multiply a GGUF file's F16, BF16 or F32 weights as stored, on the tile kernels' dense slot
(`native/shared/dense_tiles.h`, in every library: AMX's, AVX-512's and AVX2's CPUs all have F16C); the loader uses
them where the AVX2 or AVX-512 tile kernel runs (`available`).

A bf16 model would otherwise round F16 and F32 weights to bf16 (8 significant bits of F16's 11, of F32's 24), and
run BF16 ones on PyTorch's bf16 GEMM, whose roundings depend on how many tokens a pass holds. Here each weight is
widened to float32 exactly and multiplied by the model's bf16 activations in float32, on every pass alike (no int8
pass), so a verify pass agrees bit for bit with one-token decoding and the target runs its file's weights.
`pack_dense` only reorders the file's elements into blocks of 16 rows ([N/16, K, 16]); a weight costs the file's
2 or 4 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.kernels import tiles
from specdraft.kernels.tile_linear import TileLinear, require_input

ELEMENT_BYTES = {"F16": 2, "BF16": 2, "F32": 4}  # the GGUF types with a dense kernel here
_TILE_ROWS = 16


def available() -> bool:
    """Whether the loader puts F16, BF16 and F32 linears on the dense kernel: where the AVX2 or AVX-512 tile kernel
    runs (the kernel is in every library, and `TileKernel.dense_matmul` runs it on any level). Measured on a 2-core
    Zen 4 (AVX-512), a random Llama-3.2-1B in F16, 6 Spec-Bench prompts, prompt passes included: `ar` 12.7 tok/s here
    against 6.2 on PyTorch's bf16 linears (llama.cpp 12.3), and the `oracle` drafter at α 0.8 1.87x `ar` against
    1.05x (PyTorch's roundings depend on the pass width, so a verify pass rejected the target's own tokens). AMX keeps
    PyTorch's bf16 linears (its bf16 tiles; not measured against this kernel)."""
    return tiles.runs_stored_weights()


@dataclass
class PackedDense:
    """A dense matrix in blocks of 16 rows: `tiles [N/16 · K · 16 · bytes]` (uint8), each input's 16 weights side
    by side, in the file's `type_name` (F16, BF16, F32)."""

    tiles: torch.Tensor
    type_name: str
    out_features: int
    in_features: int


def pack_dense(raw: torch.Tensor, type_name: str) -> PackedDense:
    """F16, BF16 or F32 rows `[N, K · bytes]` (uint8, as the file stores them; N % 16 == 0) -> dense tiles, the same
    elements reordered."""
    element = ELEMENT_BYTES[type_name]
    n, row_bytes = raw.shape
    if raw.dtype != torch.uint8 or row_bytes % element or n % _TILE_ROWS:
        raise ValueError(f"{type_name} tiles need uint8 [N, K · {element}] with N % 16 == 0; "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    k = row_bytes // element
    words = raw.contiguous().view(torch.int16 if element == 2 else torch.int32)  # [N, K], the elements' bits
    blocks = words.view(n // _TILE_ROWS, _TILE_ROWS, k).transpose(1, 2).contiguous()  # [N/16, K, 16]
    return PackedDense(blocks.view(-1).view(torch.uint8), type_name, n, k)


def dense_matmul(packed: PackedDense, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for dense tiles; x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`."""
    require_input(packed, x)
    return tiles.tile_kernel().dense_matmul(packed.tiles, packed.type_name, x, packed.out_features)


class DenseLinear(TileLinear):
    """`y = x W^T + b` with W a GGUF F16, BF16 or F32 matrix kept as the file's elements, multiplied in float32."""

    matmul = staticmethod(dense_matmul)

    def __init__(self, raw: torch.Tensor, type_name: str, bias: torch.Tensor | None = None) -> None:
        super().__init__(pack_dense(raw, type_name), bias)
