"""How many tokens to draft each step: a fixed k, or `auto` (a cost model of this machine).

`AutoK` picks the k that maximises expected tokens per second:

    rate(k) = E[tokens | k] / (c_draft · k + V(k + 1)),   E[tokens | k] = 1 + Σ_{i≤k} Π_{j≤i} α_j

where V(t) is the target's measured time for a pass over t tokens (for widths not tried yet, a
line through the measured ones, no steeper than they show and no flatter than an optimistic prior;
smoothed measurements once tried: nothing is timed up front),
c_draft the measured draft time per token, and α_j the online estimate that draft
position j is accepted given the ones before it were (decayed counts, shrunk toward the
pooled estimate). k = 0 is plain decoding (rate 1 / V(1)), chosen whenever
speculation would not beat it by `margin` (poor acceptance, high temperature, a dear
draft); after `probe_every` plain steps a draft of the k it ranks first among k >= 1 is tried so the estimate can
recover, and each probe that shows no recovery doubles the wait (up to `max_probe_every`): nothing accepted,
or acceptance that still leaves drafting short of paying (`drafting_pays`); a probe
whose catch-up (below) would take more than a tenth of the answer's expected time left waits too.

A draft model must first read the committed tokens it has not seen (`unread`: the prompt on
its first draft, the tokens of plain steps after). That catch-up is paid once and serves the
rest of the request, so a step that drafts k is charged its share over the tokens the answer has
left, `catch_up · E[tokens | k] / left` (catch-up = unread × the source's measured read time per
token, timed on reads of at least `READ_SAMPLE_MIN` tokens; before it is timed, the draft's pass over those
tokens priced as the target's pass over as many, scaled by c). Where the answer ends is unknown, and
the budget says little (a two-line answer under a 128-token budget paid a whole prompt read for
one draft: 0.90x plain decoding on short answers): `left` is as many tokens as the answer has run
so far (an answer that has run g tokens is as likely to end before 2g as after, under a
scale-free prior on its length; Gott's "Lindy" estimate), at least `ANSWER_FLOOR`, at most the
budget left. A dear read waits until the answer has shown it is long; a cheap one is not held back.

A new request keeps the measured costs, a quarter of the acceptance counts and half the wait.
The choice never affects what is emitted, only how fast.

Timings are noisy one way: a shared machine stalls now and then, and every pass in a stall runs slow.
A new timing moves an estimate by at most what `SPIKE` times it would (one stalled step cannot price a
source out), and a cost not measured again within `STALE_STEPS` steps is forgotten: the source is priced
by the guesses above until it is timed again. Without that, a stall that made a draft model look as dear
as the target kept it unused for the rest of a run, since a cost is only re-measured when the source drafts
(measured: a 28-prompt replay where the draft model never drafted again after one stalled answer).

Trees (`tree=True`, a node budget as `max_k`): k counts nodes, E[tokens | k] = 1 + Σ_{i<k} P_i
with P_i the online estimate that the drafter's i-th node is on the accepted path (drafters
list likelier nodes first), and the draft is priced per step, not per node (a tree drafter's
passes go by depth: `rate(k) = E[tokens | k] / (c_step + V(k + 1))`).

Once a draft with scores is made (every tree drafter's, and `suffix` chains), `trim` keeps the
prefix worth verifying (a sampled tree: at least its drawn chain, `Draft.must_keep`) by what the
drafter says of this very draft: its scores s_i (each token's path probability under the drafter)
scaled by κ, how many accepted tokens each unit of score has brought so far (learnt per source, from 1), so
E[tokens | n] = 1 + κ·Σ_{i<n} s_i against c_step + V(n + 1). The budget comes from averages over
past steps; the scores tell a step whose draft is unsure (a new text, a hard turn) from a sure one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdraft.errors import SpecdraftError

AUTO = "auto"
MAX_AUTO_K = 8
GPU_MAX_AUTO_K = 32  # on a GPU a pass of 33 tokens costs about what one does (measured: docs/gpu.md)
FIRST_K = 3  # the first step's k, before anything is measured
ANSWER_FLOOR = 16  # tokens an answer is expected to run on at least, however short it is so far
PROBE_READ_SHARE = 0.1  # a probe may spend at most this share of the answer's expected time left on catching up
# Unmeasured pass widths are assumed this much dearer per extra token than one token (optimistic:
# a width that turns out dearer is measured when tried and then priced as it is).
PRIOR_SLOPE = 0.08
DEFAULT_SOURCE = "draft"  # the source name when a caller does not tell drafters apart
MARGIN = 1.05  # speculate only when it promises this much over a plain step (unmodelled costs)
SPIKE = 2.0  # a new timing counts as at most this many times the estimate it updates (stalls are one-sided)
SETTLED = 5  # timings after which an estimate moves by the smoothing alone (1 / 0.2); one given whole counts so
STALE_STEPS = 64  # a cost not measured again within this many steps is forgotten (guessed, then re-timed)
# Reading is timed from catch-ups of at least this many tokens: a few tokens ride in the draft's pass nearly free
# (it is bound by its weights), and a read rate learnt from them priced a 64-token first read (0.23 s on a 2-core
# AVX2 CPU) at a few ms, so 14-token answers paid it (extraction 0.92x ar).
READ_SAMPLE_MIN = 16


class FixedK:
    """Always draft `k` tokens (fewer near the end of the budget); with a tree budget, always
    that many nodes, at most `k` deep."""

    def __init__(self, k: int, tree_budget: int = 0) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SpecdraftError(f"--k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}.")
        self.k, self.tree_budget = k, tree_budget
        self.max_depth = k

    def begin_request(self) -> None:
        """Nothing to reset."""

    def choose(self, limit: int, source: str = DEFAULT_SOURCE, unread: int = 0, remaining: int | None = None,
               generated: int | None = None) -> int:
        return min(self.tree_budget or self.k, limit)

    def observe(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float,
                source: str | None = DEFAULT_SOURCE, path: list[int] | None = None, unread: int = 0,
                scores: list[float] | None = None, timed: bool = True, drafts_timed: bool | None = None) -> None:
        """A fixed k learns nothing."""

    def trim(self, scores: list[float], source: str = DEFAULT_SOURCE, keep: int = 1) -> int:
        """A fixed k verifies every token drafted."""
        return len(scores)


@dataclass
class SourceCosts:
    """What one draft source costs on this machine: per draft token (a tree: per step) and per committed token
    it reads to catch up, each with the step count when it was last timed (STALE_STEPS)."""

    draft_seconds_per_token: float | None = None  # a tree: per step (its passes go by depth, not by node)
    read_seconds_per_token: float | None = None  # catching up: reading one committed token it has not seen
    draft_timed_at: int = 0
    read_timed_at: int = 0
    draft_timings: int = 0  # the timings each estimate rests on (`StepCosts.smoothed`)
    read_timings: int = 0


class StepCosts:
    """The measured costs of steps on one target: a pass by width, and each draft source's `SourceCosts`.

    They belong to the machine, not to a text: one `AutoK` owns them, or the policies of a batch's sequences
    share them (the batch times its passes by their total width; each sequence times its own drafts)."""

    def __init__(self, widths: int, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self._verify_seconds: list[float | None] = [None] * widths  # [t]: a target pass over t tokens
        self._verify_timings: list[int] = [0] * widths  # [t]: the timings verify_seconds[t] rests on
        self._estimates: dict[int, float | None] = {}  # verify_estimate by width, until a pass is timed again
        self.verify_timed_at: list[int] = [0] * widths  # [t]: the step count when verify_seconds[t] was timed
        self.steps = 0  # passes timed
        self.sources: dict[str, SourceCosts] = {}

    @property
    def verify_seconds(self) -> tuple[float | None, ...]:
        """[t]: the measured seconds of a target pass over t tokens (None: not timed lately); read-only, set it
        whole (the estimates cached from it are cleared then)."""
        return tuple(self._verify_seconds)

    @verify_seconds.setter
    def verify_seconds(self, seconds: Sequence[float | None]) -> None:
        self._verify_seconds = list(seconds)
        self._verify_timings = [SETTLED if v is not None else 0 for v in seconds]  # given whole: settled
        self._estimates.clear()

    def source(self, name: str) -> SourceCosts:
        """The costs of draft source `name` (created on first use)."""
        return self.sources.setdefault(name, SourceCosts())

    def widen(self, widths: int) -> None:
        """Price passes up to `widths` - 1 tokens wide (what was timed is kept)."""
        extra = widths - len(self._verify_seconds)
        if extra > 0:
            self._verify_seconds += [None] * extra
            self._verify_timings += [0] * extra
            self.verify_timed_at += [0] * extra  # untimed widths: the cached estimates stay right

    def smoothed(self, old: float | None, new: float, timings: int = SETTLED) -> float:
        """An exponentially smoothed estimate: `new` itself when nothing was measured before; while the old one rests
        on few `timings`, their mean (an estimate from one timing at a slow moment is not worth four fifths of the
        next: measured, a 2-token pass timed once at 1.26x a one-token pass kept a fresh process plain for a whole
        answer); a stalled timing counts as at most SPIKE times the estimate."""
        if old is None:
            return new
        weight = max(self.smoothing, 1.0 / (timings + 1))
        return old + weight * ((min(new, SPIKE * old) if old > 0 else new) - old)

    def time_pass(self, width: int, seconds: float) -> None:
        """A step's target pass over `width` tokens took `seconds` (costs not timed for STALE_STEPS are forgotten)."""
        self.steps += 1
        self._forget_stale()
        if width < len(self._verify_seconds):
            self._verify_seconds[width] = self.smoothed(self._verify_seconds[width], seconds,
                                                        self._verify_timings[width])
            self._verify_timings[width] += 1
            self.verify_timed_at[width] = self.steps
        self._estimates.clear()

    def time_draft(self, source: str, per_token: float) -> None:
        """A caught-up draft by `source` took `per_token` seconds a token (a tree: a step)."""
        costs = self.source(source)
        costs.draft_seconds_per_token = self.smoothed(costs.draft_seconds_per_token, per_token, costs.draft_timings)
        costs.draft_timings += 1
        costs.draft_timed_at = self.steps

    def time_read(self, source: str, per_token: float) -> None:
        """Catching up, `source` read committed tokens at `per_token` seconds each."""
        costs = self.source(source)
        costs.read_seconds_per_token = self.smoothed(costs.read_seconds_per_token, per_token, costs.read_timings)
        costs.read_timings += 1
        costs.read_timed_at = self.steps

    def _forget_stale(self) -> None:
        """Forget every cost not timed within the last STALE_STEPS steps (module doc): a pass width not used
        since is priced from the others again, a draft source by the guesses, until it is timed anew."""
        oldest = self.steps - STALE_STEPS
        for width, timed_at in enumerate(self.verify_timed_at):
            if timed_at <= oldest:
                self._verify_seconds[width], self._verify_timings[width] = None, 0
        for costs in self.sources.values():
            if costs.draft_timed_at <= oldest:
                costs.draft_seconds_per_token, costs.draft_timings = None, 0
            if costs.read_timed_at <= oldest:
                costs.read_seconds_per_token, costs.read_timings = None, 0

    def verify_estimate(self, width: int) -> float | None:
        """Seconds of a target pass over `width` tokens: measured, or else V(1) · (1 + s · (width − 1)) scaled
        from the measured widths (None before any), with s the slope the narrowest and widest measured passes
        show, at least the optimistic PRIOR_SLOPE (on a CPU where each token of a pass costs a third of a
        one-token pass, the flat prior priced a 9-token pass at half its time); never more than a measured
        wider pass (a slow first pass of a rarely used width would otherwise keep that width unused, its
        estimate never corrected). Kept until a pass is timed again: a batch's policies ask for the same widths
        many times a step."""
        if width in self._estimates:
            return self._estimates[width]
        measured = [(w, v) for w, v in enumerate(self._verify_seconds) if v is not None]
        if not measured:
            estimate = None
        elif width < len(self._verify_seconds) and self._verify_seconds[width] is not None:
            estimate = self._verify_seconds[width]
        else:
            slope = self.measured_slope(measured)
            estimate = min(v / (1 + slope * (w - 1)) for w, v in measured) * (1 + slope * (width - 1))
        if estimate is not None:
            estimate = min([estimate] + [v for w, v in measured if w > width])
        self._estimates[width] = estimate
        return estimate

    @staticmethod
    def measured_slope(measured: list[tuple[int, float]]) -> float:
        """s with V(b) / V(a) = (1 + s(b − 1)) / (1 + s(a − 1)) for the narrowest and widest measured widths
        a < b, at least PRIOR_SLOPE (which it is with fewer than two widths, or a wider pass measured cheaper)."""
        (a, v_a), (b, v_b) = measured[0], measured[-1]
        ratio = v_b / v_a if v_a > 0 else 1.0
        denominator = (b - 1) - ratio * (a - 1)
        if b <= a or ratio <= 1.0 or denominator <= 0:
            return PRIOR_SLOPE
        return max(PRIOR_SLOPE, (ratio - 1.0) / denominator)

    def draft_seconds(self, source: str, plain: float | None = None) -> float:
        """`source`'s draft time per token (a tree: per step): measured, or before its first caught-up draft a third
        of a plain target step (`plain`, default the estimate of a one-token pass)."""
        draft = self.source(source).draft_seconds_per_token
        if draft is not None:
            return draft
        return (self.verify_estimate(1) if plain is None else plain) / 3

    def catch_up_seconds(self, unread: int, source: str, pass_seconds: float | None = None) -> float:
        """Estimated seconds for `source` to read `unread` committed tokens before drafting (0 before anything is
        measured): the measured read rate; before it is timed (or once forgotten), the reading pass priced as the
        target's pass over as many tokens, scaled by what one pass of the draft costs against one of the target,
        c · (V(unread + 1) − V(1)), with `pass_seconds` the draft's one-token pass (default the guessed third of a
        plain step). Both models read a wide pass the same way (compute-bound where each token adds work): on a
        2-core AVX2 CPU a 64-token first read took 0.14 s, about a tenth of a plain step a token, where a flat guess
        of a 24th of a plain step let a 14-token answer pay it."""
        plain = self.verify_estimate(1)
        if unread <= 0 or plain is None:
            return 0.0
        per_read = self.source(source).read_seconds_per_token
        if per_read is not None:
            return unread * per_read
        ratio = (plain / 3 if pass_seconds is None else pass_seconds) / plain
        return ratio * max(0.0, self.verify_estimate(unread + 1) - plain)


@dataclass
class SourceEstimates:
    """What AutoK has learnt about one draft source (a drafter, or one part of a composed one): its acceptance on
    this text and its probing state, and (shared by every policy over the same `StepCosts`) what it costs."""

    max_k: int
    probe_interval: int  # plain steps before the next probe; doubles after each failed one
    costs: SourceCosts = field(default_factory=SourceCosts)
    # Decayed counts per draft position i (a tree: per node i in the drafter's order): acceptances, and
    # times it was verified (a chain position after a rejection is not; every tree node is).
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)
    plain_streak: int = 0  # steps this source was asked and declined in a row
    probing: bool = False
    # Decayed sums over the tree nodes it drafted with scores: the scores, and the nodes accepted (κ = hits / mass).
    score_mass: float = 0.0
    score_hits: float = 0.0

    def __post_init__(self) -> None:
        self.hits = self.hits or [0.0] * self.max_k
        self.tries = self.tries or [0.0] * self.max_k

    @property
    def draft_seconds_per_token(self) -> float | None:
        return self.costs.draft_seconds_per_token

    @draft_seconds_per_token.setter
    def draft_seconds_per_token(self, seconds: float | None) -> None:  # given whole: settled
        self.costs.draft_seconds_per_token, self.costs.draft_timings = seconds, SETTLED if seconds is not None else 0

    @property
    def read_seconds_per_token(self) -> float | None:
        return self.costs.read_seconds_per_token

    @read_seconds_per_token.setter
    def read_seconds_per_token(self, seconds: float | None) -> None:  # given whole: settled
        self.costs.read_seconds_per_token, self.costs.read_timings = seconds, SETTLED if seconds is not None else 0


class AutoK:
    """Choose k per step from measured costs and online acceptance estimates (module doc).

    Costs of target passes are shared (they belong to the machine); acceptance, draft cost and
    probing are kept per draft source, so a composed drafter (`ngram+model`) prices each part
    by what it has shown.
    """

    def __init__(self, max_k: int = MAX_AUTO_K, prior_alpha: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, probe_every: int = 8, max_probe_every: int = 64, smoothing: float = 0.2,
                 margin: float = MARGIN, carry_over: float = 0.25, tree: bool = False,
                 costs: StepCosts | None = None) -> None:
        self.max_k = max_k  # a tree: the node budget
        self.tree = tree
        self.max_depth = MAX_AUTO_K if tree else max_k  # the deepest draft: a chain's k, a tree's depth
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.decay, self.smoothing = decay, smoothing
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.margin = margin  # speculate only when it promises this much over a plain step (unmodelled costs)
        self.carry_over = carry_over  # share of the acceptance counts a new request starts with
        self.costs = StepCosts(max_k + 2, smoothing) if costs is None else costs  # a batch's are shared
        self.costs.widen(max_k + 2)
        self.sources: dict[str, SourceEstimates] = {}
        self.last_source: str | None = None  # who drafted the previous step (None: a plain step)

    @property
    def verify_seconds(self) -> tuple[float | None, ...]:
        """[t]: the smoothed time of a target pass over t tokens (None: not timed, or forgotten)."""
        return self.costs.verify_seconds

    @verify_seconds.setter
    def verify_seconds(self, seconds: Sequence[float | None]) -> None:
        self.costs.verify_seconds = seconds
        self.costs.verify_timed_at = [self.costs.steps] * len(seconds)

    def widen(self, max_k: int) -> None:
        """Let chains run up to `max_k` draft tokens (a GPU, where a wide pass costs little more than one token);
        whatever was learnt is kept. Trees keep their node budget."""
        if self.tree or max_k <= self.max_k:
            return
        extra = max_k - self.max_k
        self.costs.widen(max_k + 2)
        for est in self.sources.values():
            est.hits += [0.0] * extra
            est.tries += [0.0] * extra
            est.max_k = max_k
        self.max_k = self.max_depth = max_k

    def estimates(self, source: str = DEFAULT_SOURCE) -> SourceEstimates:
        """The estimates of `source` (created on first use)."""
        if source not in self.sources:
            self.sources[source] = SourceEstimates(self.max_k, self.probe_every, self.costs.source(source))
        return self.sources[source]

    # ----- measuring --------------------------------------------------------------------------
    def begin_request(self) -> None:
        """A new prompt: costs carry over (they belong to the machine), acceptance mostly does not
        (it belongs to the text), and the wait between probes halves (a new text may suit the
        drafter better; a drafter that failed every probe so far still waits long, because each
        probe of a drafter with a cache also pays for reading every token it missed)."""
        for est in self.sources.values():
            est.hits = [h * self.carry_over for h in est.hits]
            est.tries = [t * self.carry_over for t in est.tries]
            est.score_mass, est.score_hits = est.score_mass * self.carry_over, est.score_hits * self.carry_over
            est.plain_streak, est.probing = 0, False
            est.probe_interval = max(self.probe_every, est.probe_interval // 2)
        self.last_source = None

    def successor(self) -> "AutoK":
        """The policy of a request that starts beside this one (a batch's joining sequence): the same settings and
        shared costs, and what `begin_request` carries over of this one's acceptance."""
        after = AutoK(self.max_k, self.prior_alpha, self.prior_weight, self.decay, self.probe_every,
                      self.max_probe_every, self.smoothing, self.margin, self.carry_over, self.tree, self.costs)
        after.max_depth = self.max_depth
        for name, est in self.sources.items():
            after.sources[name] = SourceEstimates(est.max_k, est.probe_interval, est.costs, list(est.hits),
                                                  list(est.tries), score_mass=est.score_mass, score_hits=est.score_hits)
        after.begin_request()
        return after

    def observe(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float | None,
                source: str | None = DEFAULT_SOURCE, path: list[int] | None = None, unread: int = 0,
                scores: list[float] | None = None, timed: bool = True, drafts_timed: bool | None = None) -> None:
        """Learn from one step: `k` tokens drafted by `source` after reading `unread` committed tokens,
        `accepted` of them kept (a tree: the nodes at `path`), the drafter's `scores` for them where it
        gave any, and what it cost (`verify_seconds` None: whoever ran the pass timed it, as a batch does;
        `timed=False`: the pass paid for something no later step pays, a captured CUDA graph, so its time is
        not learnt; `drafts_timed` the same of the drafts, None: as `timed`).

        `source=None` is a step where no drafter had anything to propose: only its pass is timed."""
        costs = self.costs
        if verify_seconds is not None and timed:
            costs.time_pass(k + 1, verify_seconds)
        if source is None:
            self.last_source = None
            return
        est = self.estimates(source)
        probed, est.probing = est.probing, False
        caught_up = self.last_source == source
        self.last_source = source if k > 0 else None
        if k == 0:
            if probed:
                self._after_probe(est, source, earned=False)
            return
        drafts_timed = timed if drafts_timed is None else drafts_timed
        if drafts_timed and (caught_up or unread == 0):
            # After other steps (and on a request's first draft) a draft model's first pass also reads the tokens
            # it missed, the prompt included: not a draft cost. Until a caught-up step is timed the cost is guessed;
            # a source that reads nothing first (prompt lookup, the oracle) is timed from its first draft on.
            costs.time_draft(source, draft_seconds if self.tree else draft_seconds / k)
        elif drafts_timed and unread >= READ_SAMPLE_MIN and est.draft_seconds_per_token is not None:  # the rest: a read
            drafting = est.draft_seconds_per_token * (1 if self.tree else k)
            costs.time_read(source, max(0.0, draft_seconds - drafting) / unread)
        est.hits = [h * self.decay for h in est.hits]
        est.tries = [t * self.decay for t in est.tries]
        if scores is not None:
            est.score_mass = est.score_mass * self.decay + sum(scores[:k])
            est.score_hits = est.score_hits * self.decay + accepted
        verified = k if self.tree else min(accepted + 1, k)  # a chain: positions up to the first rejection
        for i in range(verified):
            est.tries[i] += 1.0
        for i in path if path is not None else range(accepted):
            est.hits[i] += 1.0
        if probed:
            self._after_probe(est, source, earned=accepted > 0)

    def _after_probe(self, est: SourceEstimates, source: str, earned: bool) -> None:
        """The wait before `source`'s next probe: back to `probe_every` when the probe got a token accepted and what
        it showed makes drafting pay again (`drafting_pays`); else twice as long. A probe that gets one token of two
        in a text the drafter suits poorly is not a recovery: probing it every few steps cost more than it brought
        (each probe of a draft model first reads the tokens it missed)."""
        recovered = earned and self.drafting_pays(source)
        est.probe_interval = self.probe_every if recovered else min(2 * est.probe_interval, self.max_probe_every)

    def drafting_pays(self, source: str = DEFAULT_SOURCE) -> bool:
        """Whether some k > 0 beats a plain step by the margin for `source` as estimated now, its catch-up aside
        (what a probe asks: has the drafter's acceptance come back)."""
        return self.verify_estimate(1) is None or self._best_k(self.max_k, source) > 0

    # ----- choosing ---------------------------------------------------------------------------
    def pooled_alpha(self, source: str = DEFAULT_SOURCE) -> float:
        """Acceptance over all positions (with the prior): what an unobserved position is assumed to have."""
        est = self.estimates(source)
        return (sum(est.hits) + self.prior_alpha * self.prior_weight) / (sum(est.tries) + self.prior_weight)

    def alpha(self, position: int, source: str = DEFAULT_SOURCE, pooled: float | None = None) -> float:
        """Estimated chance that draft position `position` (0-based) is accepted, given the ones before were:
        its own counts, shrunk toward the pooled estimate (so positions rarely drafted are not stuck at the prior)."""
        est = self.estimates(source)
        pooled = self.pooled_alpha(source) if pooled is None else pooled
        return (est.hits[position] + pooled * self.prior_weight) / (est.tries[position] + self.prior_weight)

    def score_calibration(self, source: str = DEFAULT_SOURCE) -> float:
        """κ: accepted tokens per unit of the drafter's scores so far, shrunk toward 1 (scores taken at their word)."""
        est = self.estimates(source)
        return (est.score_hits + self.prior_weight) / (est.score_mass + self.prior_weight)

    def trim(self, scores: list[float], source: str = DEFAULT_SOURCE, keep: int = 1) -> int:
        """How many leading tokens of a drafted tree or scored chain to verify (at least `keep`, at least 1),
        given the drafter's `scores` (parents before children): the prefix n with the most expected tokens per
        second, (1 + κ·Σ_{i<n} s_i) / (c_step + V(n + 1)), the draft already made priced at the source's measured
        draft time per step of a tree drafter (whose passes go by depth) or per token of a chain drafter (the one
        scored chain, `suffix`, costs next to nothing either way; module doc). `keep`: a sampled tree's drawn
        chain, which no cut may touch (`Draft.must_keep`)."""
        keep = max(1, keep)
        if len(scores) <= keep or self.verify_estimate(1) is None:
            return len(scores)
        kappa, draft = self.score_calibration(source), self.estimates(source).draft_seconds_per_token or 0.0
        best_n, best_rate, expected = keep, 0.0, 1.0 + kappa * sum(scores[: keep - 1])
        for n in range(keep, min(len(scores), len(self.verify_seconds) - 2) + 1):  # widths the policy prices
            expected += kappa * scores[n - 1]
            rate = expected / (draft + self.verify_estimate(n + 1))
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def expected_token_curve(self, n: int, source: str = DEFAULT_SOURCE) -> list[float]:
        """E[tokens committed by a step that drafts k] for k = 0..n: accepted drafts plus the target's token.

        A chain's position i is accepted with Π_{j≤i} α_j; a tree's node i with its own estimate
        (the counts of node i are unconditional: every node is verified every step)."""
        pooled = self.pooled_alpha(source)
        curve, survive = [1.0], 1.0
        for i in range(n):
            alpha = self.alpha(i, source, pooled)
            survive = alpha if self.tree else survive * alpha
            curve.append(curve[-1] + survive)
        return curve

    def expected_tokens(self, k: int, source: str = DEFAULT_SOURCE) -> float:
        """E[tokens committed by a step that drafts k]."""
        return self.expected_token_curve(k, source)[k]

    def verify_estimate(self, width: int) -> float | None:
        """Seconds of a target pass over `width` tokens (`StepCosts.verify_estimate`; None before any is timed)."""
        return self.costs.verify_estimate(width)

    def catch_up_seconds(self, unread: int, source: str = DEFAULT_SOURCE) -> float:
        """Estimated seconds for `source` to read `unread` committed tokens first (`StepCosts.catch_up_seconds`; a
        chain drafter's measured time per token is its one-token pass, a tree's is a step of several)."""
        one_pass = None if self.tree else self.costs.source(source).draft_seconds_per_token
        return self.costs.catch_up_seconds(unread, source, one_pass)

    def draft_seconds(self, source: str = DEFAULT_SOURCE, plain: float | None = None) -> float:
        """`source`'s draft time per token (a tree: per step): measured, or guessed (`StepCosts.draft_seconds`)."""
        return self.costs.draft_seconds(source, plain)

    def expected_left(self, generated: int | None, remaining: int | None) -> float | None:
        """Tokens the answer is expected to run on (module doc): max(generated, ANSWER_FLOOR), at most
        `remaining` (the budget left); without `generated`, the budget; None: many."""
        if generated is None:
            return remaining
        left = max(generated, ANSWER_FLOOR)
        return left if remaining is None else min(left, remaining)

    def draft_cost_curve(self, n: int, source: str = DEFAULT_SOURCE, unread: int = 0, left: float | None = None,
                         curve: list[float] | None = None) -> list[float]:
        """Seconds a step drafting k = 0..n spends beside its target pass: k draft tokens (a tree: one draft
        step), and the catch-up's share over the tokens the answer has `left`, E[tokens | k] / left of it
        (module doc); `curve`: `expected_token_curve(n, source)` where the caller has it."""
        curve = self.expected_token_curve(n, source) if curve is None else curve
        draft, catch_up = self.draft_seconds(source), self.catch_up_seconds(unread, source)
        costs = [0.0]
        for k in range(1, n + 1):
            seconds = draft * (min(k, 1) if self.tree else k)
            if catch_up and left:
                seconds += catch_up * min(1.0, curve[k] / left)
            costs.append(seconds)
        return costs

    def choose(self, limit: int, source: str = DEFAULT_SOURCE, unread: int = 0, remaining: int | None = None,
               generated: int | None = None) -> int:
        """The k (0..min(limit, max_k)) with the highest expected tokens per second for `source`, which must
        first read `unread` committed tokens, with `remaining` tokens of budget left (None: many) and
        `generated` tokens of the answer so far (None: unknown, the budget alone prices the catch-up)."""
        if self.verify_estimate(1) is None:  # nothing measured yet: a moderate first draft
            return min(FIRST_K, limit)
        left = self.expected_left(generated, remaining)
        return self.probe_or(self._best_k(min(limit, self.max_k), source, unread, left), limit, source, unread, left)

    def _best_k(self, top: int, source: str, unread: int = 0, left: float | None = None, drafting: bool = False) -> int:
        """The k (0..top) with the most expected tokens per second for `source` after reading `unread` tokens
        (`left`: the answer's expected tokens left), 0 unless it beats a plain step by the margin (`drafting`: the
        best k >= 1 whatever a plain step gives); a plain step must have been timed."""
        curve = self.expected_token_curve(top, source)
        beside = self.draft_cost_curve(top, source, unread, left, curve)
        best_k, best_rate = (min(1, top), 0.0) if drafting else (0, self.margin / self.verify_estimate(1))
        for k in range(1, top + 1):
            seconds = beside[k] + self.verify_estimate(k + 1)
            if seconds > 0 and curve[k] / seconds > best_rate:
                best_k, best_rate = k, curve[k] / seconds
        return best_k

    def probe_or(self, k: int, limit: int, source: str = DEFAULT_SOURCE, unread: int = 0,
                 left: float | None = None) -> int:
        """`k` as the cost model chose it, or a probe: after `probe_interval` plain choices in a row a draft of the k
        the cost model ranks first among k >= 1, to notice a recovery and time again the
        pass that decides (a width timed once, at a slow moment, priced drafting out for a whole answer while
        plain steps kept the one-token pass up to date); not while its catch-up would cost more than a
        PROBE_READ_SHARE of the time the answer is expected to have left (`left` tokens; it could never pay back)."""
        est = self.estimates(source)
        if k > 0 or limit <= 0:
            est.plain_streak = 0
            return k
        est.plain_streak += 1
        plain = self.verify_estimate(1)
        affordable = (not left or plain is None
                      or self.catch_up_seconds(unread, source) <= PROBE_READ_SHARE * left * plain)
        if est.plain_streak > est.probe_interval and affordable:
            est.plain_streak, est.probing = 0, True
            return self._best_k(min(limit, self.max_k), source, unread, left, drafting=True)
        return 0


def make_policy(k: int | str, tree_budget: int = 0) -> FixedK | AutoK:
    """`"auto"` -> AutoK; an integer (or its string) -> FixedK. With `tree_budget` > 0 the policy
    sizes trees of up to that many nodes (auto: by the cost model; fixed: always, at most k deep)."""
    if isinstance(k, str):
        if k.strip().lower() == AUTO:
            return AutoK(max_k=tree_budget, tree=True) if tree_budget else AutoK()
        try:
            k = int(k)
        except ValueError:
            raise SpecdraftError(f"--k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}.") from None
    return FixedK(k, tree_budget)
