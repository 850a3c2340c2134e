"""Per-token decoder-layer operations in C for bf16 activations: RMSNorm (Llama's and Gemma's), rotary embedding
(each library's `layer_ops.h`)."""

from __future__ import annotations

import torch

from specdraft.kernels import numerics


def _library():
    return numerics.current().library()


def available() -> bool:
    """Whether a native library runs on this machine (AVX-512 or AVX2, as the `NumericConfig` allows)."""
    return _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight ⊙ bf16(x / sqrt(mean(x²) + eps))` over the last dimension: x `[..., dim]` bf16 (CPU, dim % 16 == 0),
    weight `[dim]` bf16 -> bf16 `[..., dim]`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _library().rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rms_norm_gain(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf16(x / sqrt(mean(x²) + eps) · gain)` over the last dimension, the products in float32 (Gemma's RMSNorm,
    gain = 1 + w): x `[..., dim]` bf16 (CPU, dim % 16 == 0), gain `[dim]` float32 -> bf16 `[..., dim]`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _library().rms_norm_gain_bf16(x.data_ptr(), gain.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rotary_(rows: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on the first `heads` heads of size `dim` of each row: rows `[1, T, ≥ heads·dim]`
    bf16 contiguous (a stacked q|k|v output), cos and sin `[1, T, dim]` bf16; the bits of transformers'
    `apply_rotary_pos_emb` in bf16."""
    if not rows.is_contiguous() or rows.shape[-1] < heads * dim or dim % 32:
        raise ValueError(f"rotary_ needs contiguous rows of at least {heads}·{dim} values, dim % 32 == 0")
    cos, sin = cos.contiguous(), sin.contiguous()
    _library().rotary_bf16(rows.data_ptr(), rows.shape[1], rows.shape[-1], heads, dim, cos.data_ptr(), sin.data_ptr())
