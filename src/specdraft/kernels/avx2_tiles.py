"""Weights in 4-bit and Q6_K tiles multiplied with AVX2 integer dot products (`avx2_tiles.c`), for x86-64
CPUs without AVX-512: 4-bit and Q6_K tiles in their own layout (`int4_layout.QUADS`, `gguf_matmul.pack_q6k`),
which the int8 kernels of `avx2_prompt` unpack with no byte shuffle; the arithmetic of the AVX-512 kernels' int16
flavour (so the same bits), `vpmaddwd` in place of `vpdpwssd`.

A tile is unpacked once per pass of up to 4 tokens; each token is computed alone, so a verify pass agrees
bit for bit with one-token decoding. The C file is compiled on first use or by `specdraft kernels`
(kernels/build.py); where it cannot build or run, or `SPECDRAFT_ISA=torch`, `available()` is False and
callers keep PyTorch's int4 kernel and unpack Q6_K to bf16.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels import avx2_prompt, isa
from specdraft.kernels.build import bind, compiled_library
from specdraft.kernels.int4_layout import QUADS, PackedInt4, run_tile_kernel

LEVEL = "avx2"
TILE_LAYOUT = QUADS  # how 4-bit and Q6_K tiles are laid out for these kernels (`int4_layout`, `gguf_matmul`)
_SOURCE = Path(__file__).with_name("avx2_tiles.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "int4_avx2_matmul": [_POINTER] * 5 + [_SIZE] * 3,  # tiles, scale, zero, x, y, N, K, tokens
    "q6k_avx2_matmul": [_POINTER] * 4 + [_SIZE] * 3,  # tiles, d, x, y, N, K, tokens
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return bind(compiled_library(_SOURCE, _FLAGS, isa.CPU_FLAGS[LEVEL], "the AVX2 tile kernels"), _SIGNATURES)


def available() -> bool:
    """Whether the AVX2 tile kernels run here (AVX2, FMA and F16C, a C compiler, and `SPECDRAFT_ISA` allows them)."""
    return isa.allows(LEVEL) and _library() is not None


def _loaded() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the AVX2 tile kernels are not available on this machine")
    return library


def matmul(packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for 4-bit tiles: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`; in a prompt pass,
    x quantized to int8 per group of 32 (`avx2_prompt`)."""
    kernel = avx2_prompt.kernel("int4_avx2_q8_matmul") if avx2_prompt.active() else _loaded().int4_avx2_matmul
    return run_tile_kernel(kernel, packed, x, TILE_LAYOUT)


def q6k_matmul(tiles: torch.Tensor, d: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x @ W^T` for Q6_K tiles (`gguf_matmul.pack_q6k`): x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`;
    in a prompt pass, x quantized to int8 per group of 32 (`avx2_prompt`)."""
    kernel = avx2_prompt.kernel("q6k_avx2_q8_matmul") if avx2_prompt.active() else _loaded().q6k_avx2_matmul
    x = x.to(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    kernel(tiles.data_ptr(), d.data_ptr(), x.data_ptr(), out.data_ptr(), out_features, x.shape[1],
                              x.shape[0])
    return out
