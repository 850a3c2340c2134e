"""Weights in 4-bit and Q6_K tiles multiplied with AVX-512 dot products (`avx512_tiles.c`), for CPUs
without AMX: a tile is unpacked once per pass of up to 8 tokens, so a verify pass of a few tokens
costs little more than one.

Two flavours of dot product (`tile_dots.dots()` picks one), one build each:
- `int16` (`vpdpwssd`, VNNI): each token's bf16 activations on an int16 grid per 16 inputs (a power
  of two each: exact for every input within 2^7 of the largest of its 16), integer sums. Faster
  where `vdpbf16ps` is slow (Intel: 62 against 43 G multiply-adds/s a core), and runs on CPUs
  without AVX-512 BF16.
- `bf16` (`vdpbf16ps`): x as it is, float32 sums; a third of the int16 flavour's float work per
  group, so faster where both instructions issue alike (AMD Zen 4: 0.54 against 0.65 ms for
  8960x1536 at 8 tokens).
Both are as close to a float32 reference (tests/test_real_kernels.py); each computes every token
alone, so a verify pass agrees bit for bit with one-token decoding under either.

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

from specdraft.kernels import isa, vnni_tiles
from specdraft.kernels.build import bind, compiled_library
from specdraft.kernels.tile_dots import build_options, dots
from specdraft.kernels.int4_layout import PAIRS, PackedInt4, run_tile_kernel

TILE_LAYOUT = PAIRS  # how 4-bit and Q6_K tiles are laid out for these kernels (`int4_layout`, `gguf_matmul`)
_SOURCE = Path(__file__).with_name("avx512_tiles.c")
# The int16 build uses no BF16 instruction: CPUs with VNNI but not BF16 (Intel Cascade Lake, Ice Lake) run it too.
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma"}
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "int4_avx512_matmul": [_POINTER] * 5 + [_SIZE] * 3,  # tiles, scale, zero, x, y, N, K, tokens
    "q6k_matmul": [_POINTER] * 4 + [_SIZE] * 3,  # tiles, d, x, y, N, K, tokens
}


def _library() -> ctypes.CDLL | None:
    return _built(dots())


@lru_cache(maxsize=None)
def _built(flavour: str) -> ctypes.CDLL | None:
    flags, required = build_options(flavour)
    return bind(compiled_library(_SOURCE, _FLAGS + flags, _REQUIRED_CPU_FLAGS | required,
                                 f"the AVX-512 tile kernels ({flavour} dot products)"), _SIGNATURES)


def available() -> bool:
    """Whether the AVX-512 tile kernels of `dots()` run on this machine (AVX-512 VNNI, BF16 for the bf16 flavour, and
    a C compiler; `SPECDRAFT_ISA` allows AVX-512)."""
    return isa.allows("avx512") and _library() is not None


def _loaded() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the AVX-512 tile kernels are not available on this machine")
    return library


def matmul(packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for 4-bit tiles: x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`; in a
    `prompt_pass.prompt_pass()`, x quantized to int8 per group of 32."""
    kernel = vnni_tiles.kernel("int4_q8_matmul") if vnni_tiles.active() else _loaded().int4_avx512_matmul
    return run_tile_kernel(kernel, packed, x, TILE_LAYOUT)


def q6k_matmul(tiles: torch.Tensor, d: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x @ W^T` for Q6_K tiles (`gguf_matmul.pack_q6k`): x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`;
    in a `prompt_pass.prompt_pass()`, x quantized to int8 per group of 32."""
    kernel = vnni_tiles.kernel("q6k_q8_matmul") if vnni_tiles.active() else _loaded().q6k_matmul
    x = x.to(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    kernel(tiles.data_ptr(), d.data_ptr(), x.data_ptr(), out.data_ptr(), out_features, x.shape[1], x.shape[0])
    return out
