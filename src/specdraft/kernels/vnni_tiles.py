"""Prompt passes on int8 activations (`vnni_tiles.c`): the 4-bit and Q6_K tiles of `avx512_tiles`
times activations quantized per group of 32, on AVX-512 VNNI integer dot products.

A prompt pass is compute-bound; these kernels do twice the multiply-adds an instruction of the
bf16 ones. They compute a slightly different function (activations keep about 8 bits), so they run
only inside `prompt_pass()`, which `CausalLM.prefill` opens: plain and speculative decoding prefill a
prompt alike, and every pass that scores a draft keeps the 16-bit kernels (`amx_tiles` on bf16,
`avx512_tiles` on int16 activations). Set `SPECDRAFT_PROMPT_INT8=0` to keep prompt passes on them too.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
from functools import lru_cache
from pathlib import Path

from specdraft.kernels import isa
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
# None outside a prompt pass; inside, how many leading rows of each matmul stay on the 16-bit kernels
_PRECISE_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("specdraft_prompt_pass", default=None)


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


def enabled() -> bool:
    """Whether prompt passes use them: available, and not turned off by `SPECDRAFT_PROMPT_INT8=0`."""
    return os.environ.get("SPECDRAFT_PROMPT_INT8", "1") != "0" and available()


@contextlib.contextmanager
def prompt_pass(starts_sequence: bool = False):
    """Within it (this thread or task), tile matmuls run on int8 activations where `enabled()`.

    `starts_sequence`: the pass begins at position 0, whose token stays on the 16-bit kernels. A
    sequence's first token is the model's attention sink, with activations hundreds of times the
    others' in a few channels (Sun et al. 2024, "Massive activations"): int8 groups cannot hold
    them (measured, the 1.5B target: logits 10% off at that position, 1-1.5% elsewhere).
    """
    token = _PRECISE_ROWS.set(1 if starts_sequence else 0)
    try:
        yield
    finally:
        _PRECISE_ROWS.reset(token)


def active() -> bool:
    """Whether the current matmul belongs to a prompt pass that should run on int8 activations."""
    return _PRECISE_ROWS.get() is not None and enabled()


def kernel(name: str):
    """Prompt kernel `name` (`int4_q8_matmul`, `q6k_q8_matmul`) with the signature of its bf16 counterpart in
    `avx512_tiles` (for `active()` passes): the pass's leading 16-bit rows are bound here."""
    precise_rows = _PRECISE_ROWS.get() or 0
    function = getattr(library(), name)
    return lambda *args: function(*args, precise_rows)


def library() -> ctypes.CDLL:
    """The compiled kernels (`int4_q8_matmul`, `q6k_q8_matmul`)."""
    loaded = _library()
    if loaded is None:
        raise RuntimeError("the AVX-512 VNNI prompt kernels are not available on this machine")
    return loaded
