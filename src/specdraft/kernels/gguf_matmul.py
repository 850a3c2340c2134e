"""Linears that multiply straight from GGUF Q6_K blocks (`gguf_matmul.c`).

PyTorch has kernels for 4-bit groups (Q4_K runs on them) but none for Q6_K's 6-bit codes
with a scale per 16 weights. The C file is compiled with the system C compiler on first
use and kept in the cache folder. It needs AVX-512 with BF16 dot products; where it cannot
build or run, `available()` is False and the loader unpacks Q6_K to bf16 instead: the same
function, slower and 2.4x larger.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from specdraft.kernels.build import compiled_library

_SOURCE = Path(__file__).with_name("gguf_matmul.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-mfma", "-fopenmp",
          "-shared", "-fPIC"]
BLOCK_BYTES = {"Q6_K": 210}  # bytes per 256 weights
# From this many tokens a pass (a prefill) unpacks the weight to bf16 for one dense GEMM: the
# block and int4 kernels cost about linearly per token, a dense bf16 GEMM (AMX/AVX-512) far less.
DENSE_FROM_TOKENS = 32
_REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or run here."""
    library = compiled_library(_SOURCE, _FLAGS, _REQUIRED_CPU_FLAGS, "the GGUF block kernels")
    if library is None:
        return None
    library.q6k_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64]
    library.q6k_matmul.restype = None
    library.int4pack_to_bf16_t.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_int64]
    library.int4pack_to_bf16_t.restype = None
    library.q6k_to_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.q6k_to_bf16.restype = None
    return library


def available() -> bool:
    """Whether the block kernels run on this machine."""
    return _library() is not None


def block_matmul(raw: torch.Tensor, type_name: str, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for W in GGUF blocks `raw [N, K / 256 · bytes]`; x `[tokens, K]` -> float32 `[tokens, N]`.

    x is rounded to bf16 (as a bf16 model's activations are); the products and sums are float32.
    """
    library = _library()
    if library is None:
        raise RuntimeError("the GGUF block kernels are not available on this machine")
    x = x.to(torch.bfloat16).contiguous()
    tokens, k = x.shape
    n = raw.shape[0]
    if raw.dtype != torch.uint8 or k % 256 or raw.shape[1] != k // 256 * BLOCK_BYTES[type_name] or not raw.is_contiguous():
        raise ValueError(f"{type_name} weight must be contiguous uint8 [N, {k // 256 * BLOCK_BYTES[type_name]}] "
                         f"for {k} inputs, got {tuple(raw.shape)} {raw.dtype}")
    if tokens >= DENSE_FROM_TOKENS:  # a prefill: unpack once, then one dense bf16 GEMM
        weight = torch.empty((n, k), dtype=torch.bfloat16)  # [N, K], dropped after the pass
        library.q6k_to_bf16(raw.data_ptr(), weight.data_ptr(), n, k)
        return torch.nn.functional.linear(x, weight).float()
    out = torch.empty((tokens, n), dtype=torch.float32)
    library.q6k_matmul(raw.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, tokens)
    return out


def int4pack_transposed(packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int,
                        in_features: int, group_size: int) -> torch.Tensor | None:
    """W^T `[K, N]` in bf16 from PyTorch's CPU int4 layout (N a multiple of 64), or None where the
    kernel is unavailable. For wide passes: one dense GEMM beats the int4 kernel by far there."""
    library = _library()
    if library is None or out_features % 64 or packed.dtype != torch.uint8 or not packed.is_contiguous():
        return None
    out = torch.empty((in_features, out_features), dtype=torch.bfloat16)
    library.int4pack_to_bf16_t(packed.data_ptr(), scales_and_zeros.contiguous().data_ptr(), out.data_ptr(),
                               out_features, in_features, group_size)
    return out


class BlockLinear(nn.Module):
    """`y = x W^T + b` with W kept in its GGUF blocks (Q6_K: 0.82 bytes a weight; bf16: 2)."""

    def __init__(self, raw: torch.Tensor, type_name: str, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if type_name not in BLOCK_BYTES:
            raise ValueError(f"no block kernel for {type_name}")
        self.register_buffer("raw", raw.contiguous())  # [N, K / 256 * bytes per block] uint8
        self.type_name = type_name
        self.out_features, self.in_features = raw.shape[0], in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def num_packed_weights(self) -> int:
        """How many weights the packed matrix holds."""
        return self.out_features * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        out = block_matmul(self.raw, self.type_name, x.reshape(-1, self.in_features))  # [tokens, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
