"""Prompt passes on int8 activations for AVX2 CPUs (`avx2_prompt.c`): the function of `vnni_tiles` (the same
bits) on `vpmaddubsw`, or AVX-VNNI's `vpdpbusd` where the CPU has it (`isa.avx_vnni`), over the tiles of
`avx2_tiles`. They run inside `prompt_pass.prompt_pass()`: prompt passes, and on AVX2 every pass by default."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from specdraft.kernels import isa, prompt_pass
from specdraft.kernels.build import bind, compiled_library

LEVEL = "avx2"
_SOURCE = Path(__file__).with_name("avx2_prompt.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "int4_avx2_q8_matmul": [_POINTER] * 5 + [_SIZE] * 4,  # tiles, scale, zero, x, y, N, K, tokens, precise tokens
    "q6k_avx2_q8_matmul": [_POINTER] * 4 + [_SIZE] * 4,  # tiles, d, x, y, N, K, tokens, precise tokens
}


@lru_cache(maxsize=2)
def _built(vnni: bool) -> ctypes.CDLL | None:
    """The kernels built for AVX2 alone, or with AVX-VNNI (`isa.avx_vnni`)."""
    flags, required, what = _FLAGS, isa.CPU_FLAGS[LEVEL], "the AVX2 prompt kernels"
    if vnni:
        flags, required, what = isa.with_avx_vnni(flags, required, what)
    return bind(compiled_library(_SOURCE, flags, required, what), _SIGNATURES)


def _library() -> ctypes.CDLL | None:
    """The AVX-VNNI build where `isa.avx_vnni()` (the AVX2 one if that fails to build), else the AVX2 one."""
    return (isa.avx_vnni() and _built(True)) or _built(False)


def available() -> bool:
    """Whether the AVX2 int8-activation kernels run here (and `SPECDRAFT_ISA` allows AVX2)."""
    return isa.allows(LEVEL) and _library() is not None


def active() -> bool:
    """Whether the current matmul belongs to a prompt pass and these kernels run here."""
    return prompt_pass.precise_rows() is not None and available()


def kernel(name: str):
    """Prompt kernel `name` (`int4_avx2_q8_matmul`, `q6k_avx2_q8_matmul`) with the signature of its 16-bit
    counterpart in `avx2_tiles` (for `active()` passes): the pass's leading 16-bit rows are bound here."""
    return prompt_pass.bound(getattr(_library(), name), prompt_pass.precise_rows() or 0)
