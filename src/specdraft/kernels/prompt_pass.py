"""Prompt passes: the context in which tile matmuls may run on int8 activations (`vnni_tiles` on AVX-512,
`avx2_prompt` on AVX2).

A prompt pass is compute-bound, and int8 dot products do twice the multiply-adds an instruction of the 16-bit
ones. They compute a slightly different function (activations keep about 8 bits), so they run only inside
`prompt_pass()`, which `CausalLM.prefill` opens: plain and speculative decoding prefill a prompt alike, and
every pass that scores a draft keeps the 16-bit kernels. Set `SPECDRAFT_PROMPT_INT8=0` to keep prompt passes on
them too.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

VARIABLE = "SPECDRAFT_PROMPT_INT8"
# None outside a prompt pass; inside, how many leading rows of each matmul stay on the 16-bit kernels
_PRECISE_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("specdraft_prompt_pass", default=None)


def enabled() -> bool:
    """Whether prompt passes may use int8 activations (not turned off by `SPECDRAFT_PROMPT_INT8=0`)."""
    return os.environ.get(VARIABLE, "1") != "0"


@contextlib.contextmanager
def prompt_pass(starts_sequence: bool = False):
    """Within it (this thread or task), tile matmuls run on int8 activations where a prompt kernel runs.

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


def precise_rows() -> int | None:
    """Inside an enabled prompt pass, how many leading rows of each matmul stay on the 16-bit kernels; else None."""
    rows = _PRECISE_ROWS.get()
    return rows if rows is not None and enabled() else None


def bound(function, rows: int):
    """A prompt kernel `function(..., tokens, precise_tokens)` with the signature of its 16-bit counterpart."""
    return lambda *args: function(*args, rows)
