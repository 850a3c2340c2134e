"""Expected gains of speculative decoding (Leviathan et al. 2022): pure arithmetic, no torch.

With per-token acceptance α (each draft token is accepted with probability α, given the ones
before it were), a chain of k draft tokens commits in expectation

    τ(α, k) = (1 - α^(k+1)) / (1 - α)        (τ = k + 1 at α = 1; τ = 1 at α = 0)

tokens per target step, and a step costs 1 + k·c target steps, c being one drafted token's
time over one target step's time, so the expected speedup is τ / (1 + k·c). That takes a pass
over k + 1 tokens to cost what one token costs; where it does not (a CPU's cores, see
`costs`), the 1 becomes the measured ratio V(k + 1) / V(1).

Note the two α's: the acceptance rate `accepted / drafted` of docs/design.md counts every draft
token, also those after a rejection that were never tested, so it is lower than the per-token α these
formulas take. `token_acceptance` estimates the per-token α from the per-position counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from specdraft.errors import SpecdraftError

def expected_tau(alpha: float, k: int) -> float:
    """τ: expected tokens committed per target step, (1 - α^(k+1)) / (1 - α); k + 1 at α = 1."""
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, verify_ratio: float = 1.0) -> float:
    """Expected speedup over plain decoding: τ(α, k) / (k·c + verify_ratio), `verify_ratio` being a pass
    over k + 1 tokens' time over a one-token pass's (1: extra tokens are free, as the classic formula
    assumes; `costs` measures it)."""
    return expected_tau(alpha, k) / (k * c + verify_ratio)


def mixed_speedup(alpha: float, steps: Mapping[int, int], c: float, pass_seconds: Mapping) -> float:
    """Expected speedup of a run whose steps drafted various k (`steps`: k -> how many steps, 0 = a plain step, as
    `k=auto` mixes them): Σ τ(α, k) over Σ (V(k + 1) / V(1) + k·c), each pass priced by the measured pass times
    (`pass_ratio_at`). One k alone gives `expected_speedup`."""
    gained = sum(count * expected_tau(alpha, k) for k, count in steps.items())
    paid = sum(count * (pass_ratio_at(pass_seconds, k + 1) + k * c) for k, count in steps.items())
    return gained / paid if paid else 1.0


def pass_ratio_at(pass_seconds: Mapping, width: int) -> float:
    """V(width) / V(1) from measured pass times (`costs`: width -> seconds, widths as ints or strings), linear
    past the widest measured (the slope of its last two widths); 1 when nothing but one token was measured."""
    seconds = {int(w): float(s) for w, s in pass_seconds.items()}
    one = seconds.get(1)
    if not one:
        return 1.0
    if width in seconds:
        return seconds[width] / one
    widths = sorted(seconds)
    below = [w for w in widths if w < width]
    above = [w for w in widths if w > width]
    if below and above:  # between two measured widths: on the line through them
        low, high = below[-1], above[0]
    elif len(widths) >= 2:  # past the widest (or below the narrowest): on the line through the nearest two
        low, high = (widths[-2], widths[-1]) if not above else (widths[0], widths[1])
    else:
        return 1.0
    slope = (seconds[high] - seconds[low]) / (high - low)
    return (seconds[low] + slope * (width - low)) / one


def best_k(alpha: float, ks: Sequence[int], c: float, slope: float = 0.0) -> int:
    """The k of `ks` with the highest expected speedup at `alpha` and `c` (the smallest such k on a tie), each
    extra token of a pass costing `slope` one-token passes."""
    return max(sorted(ks), key=lambda k: (round(expected_speedup(alpha, k, c, 1 + slope * k), 12), -k))


def token_acceptance(accepted_at: Sequence[int], drafted_at: Sequence[int]) -> float | None:
    """Per-token α estimated from per-position counts: accepted draft tokens / tested draft tokens.

    `accepted_at[i]`: steps that accepted draft position i; `drafted_at[i]`: steps that drafted
    position i. Position i was tested (compared against the target) in every step that drafted
    it and accepted all positions before it: `drafted_at[0]` at i = 0, then at most
    `min(accepted_at[i - 1], drafted_at[i])`. Accepted / tested is the maximum-likelihood α of
    independent acceptances (accepted + rejections, one rejection per step that had one).
    Example: k = 2, steps (accepted 2, accepted 0) -> accepted_at [1, 1], drafted_at [2, 2]:
    tested = 2 + 1 = 3, α = 2 / 3. None when nothing was drafted.
    """
    if not drafted_at or not drafted_at[0]:
        return None
    tested = drafted_at[0] + sum(min(accepted_at[i - 1], drafted_at[i]) for i in range(1, len(drafted_at)))
    return sum(accepted_at) / tested


# ----- the table of `specdraft theory` -------------------------------------------------------------------
@dataclass(frozen=True)
class TheoryCell:
    """Expected τ and speedup at one (α, k, c), and whether this k is the best for this α."""

    alpha: float
    k: int
    tau: float
    speedup: float
    best: bool


def theory_grid(alphas: Sequence[float], ks: Sequence[int], c: float, slope: float = 0.0) -> list[list[TheoryCell]]:
    """One row per α (in the order given), one cell per k, each extra token of a pass costing `slope` one-token
    passes (0: the classic formula); validated first."""
    validate(alphas, ks, c)
    if not (math.isfinite(slope) and slope >= 0.0):
        raise SpecdraftError(f"The pass slope must be >= 0, got {slope}.")
    rows = []
    for alpha in alphas:
        best = best_k(alpha, ks, c, slope)
        rows.append([TheoryCell(alpha, k, expected_tau(alpha, k), expected_speedup(alpha, k, c, 1 + slope * k),
                                k == best) for k in ks])
    return rows


def validate(alphas: Sequence[float], ks: Sequence[int], c: float) -> None:
    """Raise SpecdraftError unless every α is in [0, 1], every k >= 1 and c >= 0 (all finite)."""
    if not alphas:
        raise SpecdraftError("Give at least one α (--alpha 0.8 or --alpha 0.6,0.8).")
    if not ks:
        raise SpecdraftError("Give at least one k (--k 1,2,4).")
    for alpha in alphas:
        if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
            raise SpecdraftError(f"α must be in [0, 1], got {alpha}.")
    for k in ks:
        if k < 1:
            raise SpecdraftError(f"k must be >= 1, got {k}.")
    if not (math.isfinite(c) and c >= 0.0):
        raise SpecdraftError(f"c (cost ratio) must be >= 0, got {c}.")


def parse_list(text: str, kind: type, what: str) -> list:
    """A comma list of numbers (`"0.6,0.8"`) read as `kind`, in order, repeats dropped."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = kind(part)
        except ValueError:
            noun = "whole numbers" if kind is int else "numbers"
            raise SpecdraftError(f"{what} takes a comma list of {noun}; got {part!r}.") from None
        if value not in values:
            values.append(value)
    return values
