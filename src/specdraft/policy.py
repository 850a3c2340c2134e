"""How many tokens to draft each step: a fixed k, or `auto` (a cost model of this machine).

`AutoK` picks the k that maximises expected tokens per second:

    rate(k) = E[tokens | k] / (c_draft · k + V(k + 1)),   E[tokens | k] = 1 + Σ_{i≤k} Π_{j≤i} α_j

where V(t) is the target's measured time for a pass over t tokens (calibrated once at the
first request, then refined online), c_draft the measured draft time per token, and α_j
the online estimate that draft position j is accepted given the ones before it were
(decayed counts with a prior). k = 0 is plain decoding (rate 1 / V(1)), chosen whenever
speculation would not pay (poor acceptance, high temperature, a dear draft); every
`probe_every` plain steps one short draft is tried so the estimate can recover.
The choice never affects what is emitted, only how fast.
"""

from __future__ import annotations

import time

import torch

from specdraft.errors import SpecdraftError

AUTO = "auto"
MAX_AUTO_K = 10


class FixedK:
    """Always draft `k` tokens (fewer near the end of the budget)."""

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SpecdraftError(f"--k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}.")
        self.k = k

    def prepare(self, target) -> None:
        """Nothing to measure."""

    def choose(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """A fixed k learns nothing."""


class AutoK:
    """Choose k per step from measured costs and online acceptance estimates (module doc)."""

    def __init__(self, max_k: int = MAX_AUTO_K, prior_alpha: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, probe_every: int = 12, smoothing: float = 0.2) -> None:
        self.max_k = max_k
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.decay, self.probe_every, self.smoothing = decay, probe_every, smoothing
        self.verify_seconds: list[float | None] = [None] * (max_k + 2)  # [t]: a target pass over t tokens
        self.draft_seconds_per_token: float | None = None
        self.hits = [0.0] * max_k  # decayed count of acceptances at draft position i (0-based)
        self.tries = [0.0] * max_k  # decayed count of times position i was verified
        self.plain_streak = 0

    # ----- measuring --------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, target) -> None:
        """Time one target pass at each width 1..max_k+1 (once), on the current cache, then cut it back."""
        if all(v is not None for v in self.verify_seconds[1:]):
            return
        from specdraft.engine import sync_device

        length = target.cache_len
        tokens = torch.zeros((1, self.max_k + 1), dtype=torch.long, device=target.device)
        target.forward(tokens[:, :1])  # warm-up
        target.truncate(length)
        for width in range(1, self.max_k + 2):
            started = time.perf_counter()
            target.forward(tokens[:, :width], logits_to_keep=width)
            sync_device(target.device)
            self.verify_seconds[width] = time.perf_counter() - started
            target.truncate(length)

    def observe(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Learn from one step: `k` tokens drafted, `accepted` of them kept, and what it cost."""
        self._smooth_verify(k + 1, verify_seconds)
        if k == 0:
            return
        per_token = draft_seconds / k
        old = self.draft_seconds_per_token
        self.draft_seconds_per_token = per_token if old is None else old + self.smoothing * (per_token - old)
        self.hits = [h * self.decay for h in self.hits]
        self.tries = [t * self.decay for t in self.tries]
        for i in range(min(accepted + 1, k)):  # positions up to the first rejection were verified
            self.tries[i] += 1.0
            if i < accepted:
                self.hits[i] += 1.0

    def _smooth_verify(self, width: int, seconds: float) -> None:
        if width >= len(self.verify_seconds):
            return
        old = self.verify_seconds[width]
        self.verify_seconds[width] = seconds if old is None else old + self.smoothing * (seconds - old)

    # ----- choosing ---------------------------------------------------------------------------
    def alpha(self, position: int) -> float:
        """Estimated chance that draft position `position` (0-based) is accepted, given the ones before were."""
        return (self.hits[position] + self.prior_alpha * self.prior_weight) / (self.tries[position] + self.prior_weight)

    def expected_tokens(self, k: int) -> float:
        """E[tokens committed by a step that drafts k]: accepted drafts plus the target's own token."""
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.alpha(i)
            total += survive
        return total

    def step_seconds(self, k: int) -> float | None:
        """Estimated seconds of a step that drafts k, or None before the widths are measured."""
        verify = self.verify_seconds[k + 1]
        if verify is None:
            return None
        draft = self.draft_seconds_per_token
        if draft is None:  # before the first draft: guess a third of a plain target step per token
            draft = (self.verify_seconds[1] or verify) / 3
        return draft * k + verify

    def choose(self, limit: int) -> int:
        """The k (0..min(limit, max_k)) with the highest expected tokens per second."""
        best_k, best_rate = 0, 0.0
        for k in range(0, min(limit, self.max_k) + 1):
            seconds = self.step_seconds(k)
            if seconds is None or seconds <= 0:
                continue
            rate = self.expected_tokens(k) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and limit > 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:  # try a short draft now and then, to notice a recovery
                self.plain_streak = 0
                best_k = min(2, limit)
        else:
            self.plain_streak = 0
        return best_k


def make_policy(k: int | str) -> FixedK | AutoK:
    """`"auto"` -> AutoK; an integer (or its string) -> FixedK."""
    if isinstance(k, str):
        if k.strip().lower() == AUTO:
            return AutoK()
        try:
            k = int(k)
        except ValueError:
            raise SpecdraftError(f"--k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}.") from None
    return FixedK(k)
