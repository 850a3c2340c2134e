"""Few-query attention over a bf16 cache in C (each library's `attention.h`):
the CPU path of `models.attention.few_query_attention` where it builds and runs.

Measured (1.5B target, 28 layers, 300 cached keys, one query, 2 cores): see the C file's notes
and `few_query_attention`'s.
"""

from __future__ import annotations

import torch

from specdraft.kernels import numerics

_MAX_DIM = 256


def _library():
    return numerics.current().library()


def available() -> bool:
    """Whether a native library runs on this machine (AVX-512 or AVX2, as the `NumericConfig` allows)."""
    return _library() is not None


def runs_on(device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    """Whether the kernel takes states of this device, dtype and head size: CPU, bf16, a multiple of 32 up to 256."""
    return device.type == "cpu" and dtype == torch.bfloat16 and dim % 32 == 0 and dim <= _MAX_DIM and available()


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether these tensors can take the kernel: `runs_on` their device, dtype and head size, batch 1."""
    return (query.dtype == key.dtype == value.dtype and query.shape[0] == 1
            and runs_on(query.device, query.dtype, query.shape[-1]))


def _rows_contiguous(states: torch.Tensor) -> torch.Tensor:
    """A cache tensor `[1, kv_heads, S, d]` whose rows of d lie one after another (heads may lie apart)."""
    return states if states.stride(-1) == 1 and states.stride(-2) == states.shape[-1] else states.contiguous()


def attend(
    query: torch.Tensor,  # [1, heads, T, d] bf16
    key: torch.Tensor,  # [1, kv_heads, S, d] bf16
    value: torch.Tensor,  # [1, kv_heads, S, d] bf16
    attention_mask: torch.Tensor | None,  # [1, 1, T, S] bool (True = attend) or additive; None = all visible
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [1, T, heads, d] bf16
    """softmax(cap(q kᵀ · scaling) + mask) v for each query head and token (`supports` must hold), where cap(s) is
    `softcap · tanh(s / softcap)` (Gemma 2's soft-capped scores), or s itself where `softcap` is None."""
    _, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    if key.stride(1) != value.stride(1):
        key, value = key.contiguous(), value.contiguous()
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(length, keys)  # [T, S]
        if mask.dtype == torch.bool:  # the lowest finite score: a fully hidden row stays finite (uniform weights)
            mask = torch.zeros(length, keys).masked_fill_(~mask, torch.finfo(torch.float32).min)
        else:
            mask = mask.float().contiguous()
    query = query.contiguous()
    out = torch.empty((1, length, heads, dim), dtype=torch.bfloat16)
    _library().few_query_attention_bf16(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), 0 if mask is None else mask.data_ptr(), out.data_ptr(),
        heads, kv_heads, length, keys, dim, key.stride(1), scaling, softcap or 0.0,
    )
    return out
