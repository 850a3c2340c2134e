"""Passes on int8 activations: the context in which tile matmuls run on them (each library's `int8_tiles.h`: VNNI
on AVX-512, `vpmaddubsw` or AVX-VNNI on AVX2), and which passes open it.

int8 dot products do twice the multiply-adds an instruction of the 16-bit ones. They compute a slightly
different function (activations keep about 8 bits per group of 32, as llama.cpp's Q8 activations), so a model
must run every pass that decodes or scores a draft on the same one, or speculation would part from plain
decoding. `SPECDRAFT_INT8_ACTIVATIONS` (`NumericConfig.int8_activations`) chooses:
- `prompt`: only prompt passes (`CausalLM.prefill`, a draft's first read): plain and speculative decoding prefill
  alike, and every pass that scores a draft keeps the 16-bit kernels. The default where AMX runs.
- `every`: every pass of a model whose matmuls run on the AVX2 or AVX-512 tile kernels (`CausalLM.forward` opens
  the context for each; the fused decoder layers run their projections so too). The default there: each token
  beyond the first of a pass costs about half as much as on the 16-bit kernels (8960x1536 4-bit, 2 cores, Zen 3:
  3 tokens 0.62 against 1.04 ms), and a one-token pass, bound by memory, no more (the bundled 1.5B target on a
  2-core Zen 5: 8 tokens 31.9-34.3 against 41.5-43.0 ms, one token 22.9-26.7 against 22.9-24.3 ms).
- `none`: every pass on the 16-bit kernels.
The first token of a sequence (position 0) always stays on the 16-bit kernels (`prompt_pass`).
"""

from __future__ import annotations

import contextlib
import contextvars

from specdraft.kernels import numerics

# None outside a prompt pass; inside, how many leading rows of each matmul stay on the 16-bit kernels
_PRECISE_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("specdraft_prompt_pass", default=None)


def enabled() -> bool:
    """Whether passes in the context may use int8 activations (not turned off by `SPECDRAFT_INT8_ACTIVATIONS=none`)."""
    return numerics.current().int8_activations != "none"


def inside() -> bool:
    """Whether a pass context is open (in this thread or task)."""
    return _PRECISE_ROWS.get() is not None


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
