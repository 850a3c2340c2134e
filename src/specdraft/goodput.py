"""How many tokens each sequence of a batch drafts: the goodput rule for continuous batching.

A batched step verifies every active sequence in one target pass over the ragged concatenation of
their blocks ([last, d1 .. dk] per sequence), so sequence i drafting k_i tokens widens the pass to
W = Σ (k_i + 1) tokens. The step's goodput is the committed tokens of the whole batch per second:

    rate(k) = Σ_i E_i(k_i) / (V(W) + Σ_i C_i(k_i))

with E_i(k) the expected tokens committed by sequence i when it drafts k (1 + Σ_{j≤k} Π α: its own
acceptance estimates, `AutoK.expected_token_curve`), V(W) the measured time of a target pass over W
tokens, and C_i(k) what sequence i's drafting costs beside the pass: its source's draft time per token
times k (next to nothing for prompt lookup), plus a draft model's catch-up share where it must first read
tokens it missed (`AutoK.draft_cost_curve`, the single-request policy's own costs). Where a pass
costs little more for more tokens (a GPU, or a CPU at small batches) every sequence drafts; where it
is bound by compute (a CPU past a few tokens), each extra token of W costs what it would earn and
speculation turns itself off as the batch grows (vLLM's per-batch-size k, SGLang's adaptive
speculation, SmartSpec's goodput rule).

`choose_batch_k` maximises the ratio exactly for concave E_i and convex C_i (each further draft token earns
no more than the one before, as a product of α ≤ 1 does, and costs no less): Dinkelbach's method turns the
ratio into max Σ E_i(k_i) − λ · cost(k), whose best k for a fixed total S = Σ k_i is a greedy allocation of
the S tokens by marginal gain; λ is then the best rate found, until it no longer rises. A catch-up makes a
sequence's first token dearer than the next (C_i not convex): the greedy allocation may then miss the optimum
of a batch, never of one sequence alone, where it tries every k, so a batch of one chooses what
`AutoK.choose` does.

The rule prices what it can model; what it cannot (a draft's first read and catch-ups stalling the whole batch,
the per-sequence work of drafting, acceptance estimates that lag) shows only in the time steps take.
`RealizedGoodput` keeps, per batch size, the committed tokens per second that steps which drafted and steps
which did not actually gave; where drafting has given less than plain steps there (each kind measured on at
least REALIZED_STEPS steps), the batch steps plain at that size and tries drafting again RETRY_STEPS steps later.
A try that loses again doubles the wait there, up to MAX_RETRY_STEPS (a try is dear where it loses: a draft model
must first read every token it missed, for every sequence at once; measured, steps of 8 sequences that drafted gave
126 tokens/s against 172 for plain steps); a try that pays sets it back to RETRY_STEPS.

Asking costs too: each sequence's policy plans its step and the rule weighs the batch, host work a plain step of
plain batching never does (a 16-sequence step on a CPU's tiny test model: about 1.4 ms of about 7). Where the
policies and the rule chose plain for every sequence at a batch size (`RealizedGoodput.declined`), the next
PAUSE_STEPS steps there step plain without asking: where drafting does not pay, a batch asks at one step in
PAUSE_STEPS + 1, and where it starts to pay, it drafts at most PAUSE_STEPS steps later.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

DINKELBACH_ROUNDS = 32  # far more than it takes: λ stops rising after a few rounds
REALIZED_DECAY = 0.95  # the weight of each older step at a batch size in its realized rates (about the last 20)
REALIZED_STEPS = 8  # steps of each kind at a batch size before its realized rates may stop drafting there
RETRY_STEPS = 32  # once drafting lost at a batch size, plain steps there before it may draft again
MAX_RETRY_STEPS = 256  # the longest wait, after tries that lost in a row (each doubles it)
PAUSE_STEPS = 4  # plain steps a batch size takes without asking after its policies and rule chose plain there


def batch_rate(ks: Sequence[int], curves: Sequence[Sequence[float]], beside: Sequence[Sequence[float]],
               verify_seconds: Callable[[int], float]) -> float:
    """Expected committed tokens per second of a step where sequence i drafts ks[i]."""
    width = sum(k + 1 for k in ks)
    seconds = verify_seconds(width) + sum(cost[k] for cost, k in zip(beside, ks))
    return sum(curve[k] for curve, k in zip(curves, ks)) / seconds


def _gain(lam: float, curve: Sequence[float], cost: Sequence[float], k: int) -> float:
    """What sequence drafting its (k + 1)-th token adds to Σ E − λ·Σ C."""
    return curve[k + 1] - curve[k] - lam * (cost[k + 1] - cost[k])


def _best_for(lam: float, curves: Sequence[Sequence[float]], beside: Sequence[Sequence[float]],
              verify_seconds: Callable[[int], float], max_width: int | None = None) -> list[int]:
    """argmax over k of Σ E_i(k_i) − λ·(V(B + S) + Σ C_i(k_i)): for each total S, the S tokens go greedily to the
    largest marginal gains E_i(k+1) − E_i(k) − λ·(C_i(k+1) − C_i(k)) (non-increasing in k: exact); then the best S,
    with B + S at most `max_width` where given."""
    batch = len(curves)
    ks = [0] * batch
    heap = [(-_gain(lam, curve, cost, 0), i) for i, (curve, cost) in enumerate(zip(curves, beside)) if len(curve) > 1]
    heapq.heapify(heap)
    gained = sum(curve[0] for curve in curves)
    best_value, best_ks = gained - lam * verify_seconds(batch), list(ks)
    total = 0
    while heap and (max_width is None or batch + total < max_width):
        negative_gain, i = heapq.heappop(heap)
        ks[i] += 1
        total += 1
        gained -= negative_gain
        value = gained - lam * verify_seconds(batch + total)
        if value > best_value:
            best_value, best_ks = value, list(ks)
        curve = curves[i]
        if ks[i] + 1 < len(curve):
            heapq.heappush(heap, (-_gain(lam, curve, beside[i], ks[i]), i))
    return best_ks


def choose_batch_k(curves: Sequence[Sequence[float]], beside: Sequence[Sequence[float]],
                   verify_seconds: Callable[[int], float], margin: float = 1.0,
                   max_width: int | None = None) -> list[int]:
    """The draft length of each sequence that maximises the batch's committed tokens per second (module doc).

    curves[i][k]: expected tokens sequence i commits drafting k (curves[i][0] = 1; its length bounds k);
    beside[i][k]: seconds sequence i's drafting of k tokens costs beside the pass (beside[i][0] = 0, as long as
    curves[i]); verify_seconds(W): a target pass over W tokens. Speculation must beat the plain step (every k = 0)
    by `margin`, else every sequence steps plain. `max_width`: the widest pass W = Σ (k_i + 1) allowed (a GPU's
    widest captured pass: a wider one runs eagerly, at several times its cost, and the estimate of a width not yet
    timed would not know it)."""
    if len(curves) != len(beside) or any(len(c) != len(b) for c, b in zip(curves, beside)):
        raise ValueError("one cost curve per sequence, as long as its token curve")
    plain = [0] * len(curves)
    if not curves:
        return plain
    best = plain
    best_rate = batch_rate(best, curves, beside, verify_seconds)
    lam = best_rate
    for _ in range(DINKELBACH_ROUNDS):
        ks = _best_for(lam, curves, beside, verify_seconds, max_width)
        rate = batch_rate(ks, curves, beside, verify_seconds)
        if rate <= best_rate * (1 + 1e-12):
            break
        best, best_rate, lam = ks, rate, rate
    if best_rate < margin * batch_rate(plain, curves, beside, verify_seconds):
        return plain
    return best


@dataclass
class _Rates:
    """Decayed sums of committed tokens and seconds of one batch size's steps, drafting and plain."""

    tokens: list[float]  # [plain, drafting]
    seconds: list[float]
    steps: list[int]
    waited: int = 0  # plain steps since drafting was last judged to lose here
    retry_after: int = RETRY_STEPS  # plain steps to wait before the next try: doubled by each try that loses
    paused: int = 0  # plain steps left before the policies and the rule are asked again

    def rate(self, drafting: bool) -> float:
        return self.tokens[drafting] / self.seconds[drafting] if self.seconds[drafting] > 0 else 0.0


class RealizedGoodput:
    """What drafting has actually given at each batch size, against plain steps (module doc)."""

    def __init__(self) -> None:
        self._sizes: dict[int, _Rates] = {}

    def record(self, size: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step of `size` sequences that drafted (or not) committed `tokens` in `seconds`."""
        rates = self._sizes.setdefault(size, _Rates([0.0, 0.0], [0.0, 0.0], [0, 0]))
        was_paying = self.drafting_pays(size)
        for kind in (False, True):  # both decay, so the kind not taken lately weighs little once it is taken again
            rates.tokens[kind] *= REALIZED_DECAY
            rates.seconds[kind] *= REALIZED_DECAY
        rates.tokens[drafting] += tokens
        rates.seconds[drafting] += seconds
        rates.steps[drafting] += 1
        if not drafting and rates.paused:
            rates.paused -= 1
        pays = self.drafting_pays(size)
        if drafting:
            rates.waited = 0
            if pays:
                rates.retry_after = RETRY_STEPS
            elif not was_paying:  # a try, and it lost again
                rates.retry_after = min(2 * rates.retry_after, MAX_RETRY_STEPS)
        elif not pays:
            rates.waited += 1

    def drafting_pays(self, size: int) -> bool:
        """Whether steps that drafted have given at least the tokens per second of plain steps at this batch size
        (True until both kinds have been seen REALIZED_STEPS times)."""
        rates = self._sizes.get(size)
        if rates is None or min(rates.steps) < REALIZED_STEPS:
            return True
        return rates.rate(True) >= rates.rate(False)

    def declined(self, size: int) -> None:
        """A step of `size` sequences, asked, chose plain: the next steps there step plain without asking (module
        doc)."""
        self._sizes.setdefault(size, _Rates([0.0, 0.0], [0.0, 0.0], [0, 0])).paused = PAUSE_STEPS

    def allows_drafting(self, size: int) -> bool:
        """Whether a step of `size` sequences may draft: not within a pause after a decline, and drafting pays
        there, or it lost and has waited its plain steps (RETRY_STEPS, doubled by each try that lost since; then
        one try measures it again)."""
        rates = self._sizes.get(size)
        if rates is not None and rates.paused:
            return False
        if self.drafting_pays(size):
            return True
        return rates.waited >= rates.retry_after
