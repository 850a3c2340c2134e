"""How many tokens to draft each step: a fixed k, or `auto` (a cost model of this machine).

`AutoK` picks the k that maximises expected tokens per second:

    rate(k) = E[tokens | k] / (c_draft · k + V(k + 1)),   E[tokens | k] = 1 + Σ_{i≤k} Π_{j≤i} α_j

where V(t) is the target's measured time for a pass over t tokens (an optimistic prior
for widths not tried yet, then smoothed measurements: nothing is timed up front),
c_draft the measured draft time per token, and α_j the online estimate that draft
position j is accepted given the ones before it were (decayed counts, shrunk toward the
pooled estimate). k = 0 is plain decoding (rate 1 / V(1)), chosen whenever
speculation would not beat it by `margin` (poor acceptance, high temperature, a dear
draft); after `probe_every` plain steps one short draft is tried so the estimate can
recover, and each failed probe doubles the wait (up to `max_probe_every`). A new request
keeps the measured costs and a quarter of the acceptance counts.
The choice never affects what is emitted, only how fast.
"""

from __future__ import annotations

from specdraft.errors import SpecdraftError

AUTO = "auto"
MAX_AUTO_K = 8
FIRST_K = 3  # the first step's k, before anything is measured
PROBE_K = 2  # the k of a probe during plain decoding
# Unmeasured pass widths are assumed this much dearer per extra token than one token (optimistic:
# a width that turns out dearer is measured when tried and then priced as it is).
PRIOR_SLOPE = 0.08


class FixedK:
    """Always draft `k` tokens (fewer near the end of the budget)."""

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SpecdraftError(f"--k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}.")
        self.k = k

    def begin_request(self) -> None:
        """Nothing to reset."""

    def choose(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """A fixed k learns nothing."""


class AutoK:
    """Choose k per step from measured costs and online acceptance estimates (module doc)."""

    def __init__(self, max_k: int = MAX_AUTO_K, prior_alpha: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, probe_every: int = 8, max_probe_every: int = 64, smoothing: float = 0.2,
                 margin: float = 1.05, carry_over: float = 0.25) -> None:
        self.max_k = max_k
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.decay, self.smoothing = decay, smoothing
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probe_interval = probe_every  # plain steps before the next probe; doubles after each failed one
        self.probing = False
        self.margin = margin  # speculate only when it promises this much over a plain step (unmodelled costs)
        self.carry_over = carry_over  # share of the acceptance counts a new request starts with
        self.verify_seconds: list[float | None] = [None] * (max_k + 2)  # [t]: a target pass over t tokens
        self.draft_seconds_per_token: float | None = None
        self.hits = [0.0] * max_k  # decayed count of acceptances at draft position i (0-based)
        self.tries = [0.0] * max_k  # decayed count of times position i was verified
        self.plain_streak = 0
        self.last_k = 0  # the previous step's k: after a plain step the draft first catches up

    # ----- measuring --------------------------------------------------------------------------
    def begin_request(self) -> None:
        """A new prompt: costs carry over (they belong to the machine), acceptance mostly does not
        (it belongs to the text), and probing starts afresh."""
        self.hits = [h * self.carry_over for h in self.hits]
        self.tries = [t * self.carry_over for t in self.tries]
        self.plain_streak, self.last_k = 0, 0
        self.probe_interval, self.probing = self.probe_every, False

    def observe(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Learn from one step: `k` tokens drafted, `accepted` of them kept, and what it cost."""
        if self.probing:  # a failed probe waits twice as long for the next one; a full one resets
            full = k > 0 and accepted == k
            self.probe_interval = self.probe_every if full else min(2 * self.probe_interval, self.max_probe_every)
            self.probing = False
        self._smooth_verify(k + 1, verify_seconds)
        caught_up, self.last_k = self.last_k == 0, k
        if k == 0:
            return
        if not caught_up or self.draft_seconds_per_token is None:
            # After plain steps the draft's first pass also reads the tokens it missed: not a draft cost.
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
    def pooled_alpha(self) -> float:
        """Acceptance over all positions (with the prior): what an unobserved position is assumed to have."""
        return (sum(self.hits) + self.prior_alpha * self.prior_weight) / (sum(self.tries) + self.prior_weight)

    def alpha(self, position: int, pooled: float | None = None) -> float:
        """Estimated chance that draft position `position` (0-based) is accepted, given the ones before were:
        its own counts, shrunk toward the pooled estimate (so positions rarely drafted are not stuck at the prior)."""
        pooled = self.pooled_alpha() if pooled is None else pooled
        return (self.hits[position] + pooled * self.prior_weight) / (self.tries[position] + self.prior_weight)

    def expected_token_curve(self, n: int) -> list[float]:
        """E[tokens committed by a step that drafts k] for k = 0..n: accepted drafts plus the target's token."""
        pooled = self.pooled_alpha()
        curve, survive = [1.0], 1.0
        for i in range(n):
            survive *= self.alpha(i, pooled)
            curve.append(curve[-1] + survive)
        return curve

    def expected_tokens(self, k: int) -> float:
        """E[tokens committed by a step that drafts k]."""
        return self.expected_token_curve(k)[k]

    def verify_estimate(self, width: int) -> float | None:
        """Seconds of a target pass over `width` tokens: measured, or else the optimistic prior
        V(1) · (1 + PRIOR_SLOPE · (width − 1)) scaled from the measured widths (None before any)."""
        if self.verify_seconds[width] is not None:
            return self.verify_seconds[width]
        scales = [v / (1 + PRIOR_SLOPE * (w - 1)) for w, v in enumerate(self.verify_seconds) if v is not None]
        return min(scales) * (1 + PRIOR_SLOPE * (width - 1)) if scales else None

    def step_seconds(self, k: int) -> float | None:
        """Estimated seconds of a step that drafts k, or None before anything is measured."""
        verify = self.verify_estimate(k + 1)
        if verify is None:
            return None
        draft = self.draft_seconds_per_token
        if draft is None:  # before the first draft: guess a third of a plain target step per token
            draft = self.verify_estimate(1) / 3
        return draft * k + verify

    def choose(self, limit: int) -> int:
        """The k (0..min(limit, max_k)) with the highest expected tokens per second."""
        if self.step_seconds(0) is None:  # nothing measured yet: a moderate first draft
            return min(FIRST_K, limit)
        plain_rate = 1.0 / self.step_seconds(0)
        best_k, best_rate = 0, plain_rate * self.margin
        top = min(limit, self.max_k)
        curve = self.expected_token_curve(top)
        for k in range(1, top + 1):
            seconds = self.step_seconds(k)
            if seconds is None or seconds <= 0:
                continue
            rate = curve[k] / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and limit > 0:
            self.plain_streak += 1
            if self.plain_streak > self.probe_interval:  # a short draft now and then, to notice a recovery
                self.plain_streak, self.probing = 0, True
                best_k = min(PROBE_K, limit)
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
