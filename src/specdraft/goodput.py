"""How many tokens each sequence of a batch drafts: the goodput rule for continuous batching.

A batched step verifies every active sequence in one target pass over the ragged concatenation of
their blocks ([last, d1 .. dk] per sequence), so sequence i drafting k_i tokens widens the pass to
W = Σ (k_i + 1) tokens. The step's goodput is the committed tokens of the whole batch per second:

    rate(k) = Σ_i E_i(k_i) / (V(W) + Σ_i c_i · k_i)

with E_i(k) the expected tokens committed by sequence i when it drafts k (1 + Σ_{j≤k} Π α: its own
acceptance estimates, `AutoK.expected_token_curve`), V(W) the measured time of a target pass over W
tokens, and c_i the draft time per token of sequence i's source (0 for prompt lookup). Where a pass
costs little more for more tokens (a GPU, or a CPU at small batches) every sequence drafts; where it
is bound by compute (a CPU past a few tokens), each extra token of W costs what it would earn and
speculation turns itself off as the batch grows (vLLM's per-batch-size k, SGLang's adaptive
speculation, SmartSpec's goodput rule).

`choose_batch_k` maximises the ratio exactly for concave E_i (each further draft token earns no more
than the one before, as a product of α ≤ 1 does): Dinkelbach's method turns the ratio into
max Σ E_i(k_i) − λ · cost(k), whose best k for a fixed total S = Σ k_i is a greedy allocation of the
S tokens by marginal gain; λ is then the best rate found, until it no longer rises.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

DINKELBACH_ROUNDS = 32  # far more than it takes: λ stops rising after a few rounds


def batch_rate(ks: Sequence[int], curves: Sequence[Sequence[float]], draft_costs: Sequence[float],
               verify_seconds: Callable[[int], float]) -> float:
    """Expected committed tokens per second of a step where sequence i drafts ks[i]."""
    width = sum(k + 1 for k in ks)
    seconds = verify_seconds(width) + sum(c * k for c, k in zip(draft_costs, ks))
    return sum(curve[k] for curve, k in zip(curves, ks)) / seconds


def _best_for(lam: float, curves: Sequence[Sequence[float]], draft_costs: Sequence[float],
              verify_seconds: Callable[[int], float]) -> list[int]:
    """argmax over k of Σ E_i(k_i) − λ·(V(B + S) + Σ c_i k_i): for each total S, the S tokens go greedily to the
    largest marginal gains E_i(k+1) − E_i(k) − λ·c_i (non-increasing in k: exact); then the best S."""
    batch = len(curves)
    ks = [0] * batch
    heap = [(-(curve[1] - curve[0] - lam * cost), i) for i, (curve, cost) in enumerate(zip(curves, draft_costs))
            if len(curve) > 1]
    heapq.heapify(heap)
    gained = sum(curve[0] for curve in curves)
    best_value, best_ks = gained - lam * verify_seconds(batch), list(ks)
    total = 0
    while heap:
        negative_gain, i = heapq.heappop(heap)
        ks[i] += 1
        total += 1
        gained -= negative_gain
        value = gained - lam * verify_seconds(batch + total)
        if value > best_value:
            best_value, best_ks = value, list(ks)
        curve = curves[i]
        if ks[i] + 1 < len(curve):
            heapq.heappush(heap, (-(curve[ks[i] + 1] - curve[ks[i]] - lam * draft_costs[i]), i))
    return best_ks


def choose_batch_k(curves: Sequence[Sequence[float]], draft_costs: Sequence[float],
                   verify_seconds: Callable[[int], float], margin: float = 1.0) -> list[int]:
    """The draft length of each sequence that maximises the batch's committed tokens per second (module doc).

    curves[i][k]: expected tokens sequence i commits drafting k (curves[i][0] = 1; its length bounds k);
    draft_costs[i]: seconds a draft token of sequence i costs; verify_seconds(W): a target pass over W tokens.
    Speculation must beat the plain step (every k = 0) by `margin`, else every sequence steps plain."""
    if len(curves) != len(draft_costs):
        raise ValueError("one draft cost per sequence")
    plain = [0] * len(curves)
    if not curves:
        return plain
    best = plain
    best_rate = batch_rate(best, curves, draft_costs, verify_seconds)
    lam = best_rate
    for _ in range(DINKELBACH_ROUNDS):
        ks = _best_for(lam, curves, draft_costs, verify_seconds)
        rate = batch_rate(ks, curves, draft_costs, verify_seconds)
        if rate <= best_rate * (1 + 1e-12):
            break
        best, best_rate, lam = ks, rate, rate
    if best_rate < margin * batch_rate(plain, curves, draft_costs, verify_seconds):
        return plain
    return best
