"""Weights in 4-bit and Q6_K tiles multiplied with AVX-512 VNNI int16 dot products (`avx512_tiles.c`), for
CPUs without AMX: a tile is unpacked once per pass of up to 8 tokens, so a verify pass of a few
tokens costs little more than one. Each token's bf16 activations are taken on an int16 grid per
group of 32 (a power of two each: exact for every input within 2^7 of the group's largest), and the
sums are integers (see the C file).

- 4-bit: the layout of `int4_layout.pack` (shared with the AMX kernel); `matmul(packed, x)` is
  `x @ W^T` in float32, for passes of any width (prefills too: 8 tokens at a time).
- Q6_K: the tiles of `gguf_matmul.pack_q6k`; `q6k_matmul` likewise.

The C file is compiled on first use (kernels/build.py); where it cannot build or run,
`available()` is False and callers keep PyTorch's int4 kernel and unpack Q6_K to bf16.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels import vnni_tiles
from specdraft.kernels.build import bind, compiled_library
from specdraft.kernels.int4_layout import PackedInt4, run_tile_kernel

_SOURCE = Path(__file__).with_name("avx512_tiles.c")
# No BF16 instruction is used: CPUs with VNNI but not BF16 (Intel Cascade Lake, Ice Lake) run these kernels too.
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma"}
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "int4_avx512_matmul": [_POINTER] * 5 + [_SIZE] * 3,  # tiles, scale, zero, x, y, N, K, tokens
    "q6k_matmul": [_POINTER] * 4 + [_SIZE] * 3,  # tiles, d, x, y, N, K, tokens
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return bind(compiled_library(_SOURCE, _FLAGS, _REQUIRED_CPU_FLAGS, "the AVX-512 tile kernels"), _SIGNATURES)


def available() -> bool:
    """Whether the AVX-512 tile kernels run on this machine (AVX-512 VNNI and a C compiler)."""
    return _library() is not None


def _loaded() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the AVX-512 tile kernels are not available on this machine")
    return library


def matmul(packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for 4-bit tiles: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`; in a
    `vnni_tiles.prompt_pass()`, x quantized to int8 per group of 32."""
    kernel = vnni_tiles.kernel("int4_q8_matmul") if vnni_tiles.active() else _loaded().int4_avx512_matmul
    return run_tile_kernel(kernel, packed, x)


def q6k_matmul(tiles: torch.Tensor, d: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x @ W^T` for Q6_K tiles (`gguf_matmul.pack_q6k`): x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`;
    in a `vnni_tiles.prompt_pass()`, x quantized to int8 per group of 32."""
    kernel = vnni_tiles.kernel("q6k_q8_matmul") if vnni_tiles.active() else _loaded().q6k_matmul
    x = x.to(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    kernel(tiles.data_ptr(), d.data_ptr(), x.data_ptr(), out.data_ptr(), out_features, x.shape[1], x.shape[0])
    return out
