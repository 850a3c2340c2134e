"""Prompt passes on int8 activations (`vnni_tiles.c`): the 4-bit and Q6_K tiles of `avx512_tiles`
times activations quantized per group of 32, on AVX-512 VNNI integer dot products.

They run inside `prompt_pass.prompt_pass()`: by default every pass where the AVX-512 tiles run (see there why),
prompt passes only where AMX runs (its passes that score a draft stay on `amx_tiles`' bf16).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from specdraft.kernels import isa, prompt_pass
from specdraft.kernels.build import bind, compiled_library
from specdraft.kernels.tile_dots import build_options, dots

_SOURCE = Path(__file__).with_name("vnni_tiles.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-fopenmp",
          "-shared", "-fPIC"]
_REQUIRED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni", "fma"}
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "int4_q8_matmul": [_POINTER] * 5 + [_SIZE] * 4,  # tiles, scale, zero, x, y, N, K, tokens, precise tokens
    "q6k_q8_matmul": [_POINTER] * 4 + [_SIZE] * 4,  # tiles, d, x, y, N, K, tokens, precise tokens
}


def _library() -> ctypes.CDLL | None:
    return _built(dots())


@lru_cache(maxsize=None)
def _built(flavour: str) -> ctypes.CDLL | None:  # the leading precise rows run on the tile kernels of `flavour`
    flags, required = build_options(flavour)
    return bind(compiled_library(_SOURCE, _FLAGS + flags, _REQUIRED_CPU_FLAGS | required, "the AVX-512 VNNI prompt kernels"),
                _SIGNATURES)


def available() -> bool:
    """Whether the int8-activation kernels run on this machine (and `SPECDRAFT_ISA` allows AVX-512)."""
    return isa.allows("avx512") and _library() is not None


def active() -> bool:
    """Whether the current matmul belongs to a prompt pass (`prompt_pass.prompt_pass`) and these kernels run here."""
    return prompt_pass.precise_rows() is not None and available()


def kernel(name: str):
    """Prompt kernel `name` (`int4_q8_matmul`, `q6k_q8_matmul`) with the signature of its 16-bit counterpart in
    `avx512_tiles` (for `active()` passes): the pass's leading 16-bit rows are bound here."""
    return prompt_pass.bound(getattr(library(), name), prompt_pass.precise_rows() or 0)


def library() -> ctypes.CDLL:
    """The compiled kernels (`int4_q8_matmul`, `q6k_q8_matmul`)."""
    loaded = _library()
    if loaded is None:
        raise RuntimeError("the AVX-512 VNNI prompt kernels are not available on this machine")
    return loaded
