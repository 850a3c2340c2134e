"""Server metrics in Prometheus' text format (no client library: a few counters and one histogram)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from specdraft.stats import GenerationStats

# Upper bounds of the histograms' buckets: time per output token (s), and per batched step: sequences, draft
# tokens chosen in all (the goodput rule's k summed; 0: speculation stepped aside), committed tokens per second.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
GOODPUT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts = bounds, [0] * len(bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound

    def samples(self) -> list[tuple[str, float]]:
        return [*((f'_bucket{{le="{bound}"}}', n) for bound, n in zip(self.bounds, self.counts)),
                ('_bucket{le="+Inf"}', self.count), ("_sum", self.sum), ("_count", self.count)]


def _number(value: float) -> str:
    """A sample value as Prometheus reads it: integers exactly, floats in full precision."""
    return str(value) if isinstance(value, int) else repr(float(value))


class Metrics:
    """Counts requests and generated tokens; `render` writes them out. Safe from any thread."""

    def __init__(self, queue_depth: Callable[[], int], in_flight: Callable[[], int],
                 kv_cache: Callable[[], tuple[int, int | None]] | None = None) -> None:
        self._lock = threading.Lock()
        self._queue_depth, self._in_flight = queue_depth, in_flight
        self._kv_cache = kv_cache  # (bytes reserved, budget or None) of the batched engine
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.cancelled = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.cached_prompt_tokens = 0  # of the prompt tokens, those taken from the prefix cache
        self.steps = self.drafted = self.accepted = 0
        self.accepted_at: list[int] = []
        self.drafted_at: list[int] = []
        self.tpot = Histogram(TPOT_BUCKETS)
        self.batch_size, self.batch_drafted = Histogram(BATCH_SIZE_BUCKETS), Histogram(BATCH_DRAFT_BUCKETS)
        self.batch_goodput = Histogram(GOODPUT_BUCKETS)
        self.pass_seconds: dict[int, list[float]] = {}  # target pass width -> [seconds summed, passes]

    def record_request(self, endpoint: str, status: int) -> None:
        """One answered request (any status)."""
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record_cancelled(self) -> None:
        """A generation stopped early: its client went away, it timed out, or the server shut down."""
        with self._lock:
            self.cancelled += 1

    def record_generation(self, stats: GenerationStats) -> None:
        """The tokens and speculation counts of one request (its choices summed)."""
        with self._lock:
            self.prompt_tokens += stats.prompt_tokens
            self.cached_prompt_tokens += stats.cached_prompt_tokens
            self.completion_tokens += stats.new_tokens
            self.steps += stats.steps
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            for mine, theirs in ((self.accepted_at, stats.accepted_at), (self.drafted_at, stats.drafted_at)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, count in enumerate(theirs):
                    mine[i] += count
            if stats.new_tokens:
                self.tpot.observe(stats.wall_seconds / stats.new_tokens)

    def record_batch_step(self, sequences: int, drafted: int, committed: int, seconds: float, width: int = 0,
                          pass_seconds: float | None = None) -> None:
        """One step of the batched engine: how many sequences, draft tokens in all, tokens committed, its time; the
        target pass's width (tokens) and seconds, where it was timed."""
        with self._lock:
            self.batch_size.observe(sequences)
            self.batch_drafted.observe(drafted)
            if seconds > 0:
                self.batch_goodput.observe(committed / seconds)
            if width > 0 and pass_seconds is not None:
                summed = self.pass_seconds.setdefault(width, [0.0, 0])
                summed[0] += pass_seconds
                summed[1] += 1

    def totals(self) -> dict[str, float]:
        """The main figures now, for a collector outside the process (`surfaces.scale_out`): counts since start
        (`*_total`), α, τ, and the queue and running gauges."""
        with self._lock:
            return {"requests_total": sum(self.requests.values()), "prompt_tokens_total": self.prompt_tokens,
                    "generation_tokens_total": self.completion_tokens, "steps_total": self.steps,
                    "draft_tokens_total": self.drafted, "accepted_tokens_total": self.accepted,
                    "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                    "mean_committed_per_step": self.completion_tokens / self.steps if self.steps else 0.0,
                    "queue_depth": self._queue_depth(), "requests_running": self._in_flight()}

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        totals = self.totals()
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(f"{name}{suffix} {_number(value)}" for suffix, value in samples)

            metric("specdraft_requests_total", "counter", "Answered requests by endpoint and HTTP status.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("specdraft_requests_cancelled_total", "counter",
                   "Generations stopped early (client gone, timeout, shutdown).", [("", self.cancelled)])
            metric("specdraft_prompt_tokens_total", "counter", "Prompt tokens prefilled (once per choice).",
                   [("", self.prompt_tokens)])
            metric("specdraft_prompt_tokens_cached_total", "counter",
                   "Of the prompt tokens, those whose cached rows were reused from an earlier prompt (not read).",
                   [("", self.cached_prompt_tokens)])
            metric("specdraft_generation_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
            metric("specdraft_steps_total", "counter", "Target verification steps.", [("", self.steps)])
            metric("specdraft_draft_tokens_total", "counter", "Draft tokens proposed.", [("", self.drafted)])
            metric("specdraft_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", self.accepted)])
            metric("specdraft_acceptance_rate", "gauge", "alpha: accepted / drafted since start.",
                   [("", totals["acceptance_rate"])])
            metric("specdraft_mean_committed_per_step", "gauge", "tau: generated tokens / steps since start.",
                   [("", totals["mean_committed_per_step"])])
            metric("specdraft_position_drafted_total", "counter", "Steps whose draft reached position p (1-based).",
                   [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(self.drafted_at)])
            metric("specdraft_position_accepted_total", "counter", "Steps whose accepted path reached position p.",
                   [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(self.accepted_at)])
            metric("specdraft_position_acceptance_rate", "gauge", "Acceptance at draft position p.",
                   [(f'{{position="{i + 1}"}}', a / d if d else 0.0)
                    for i, (a, d) in enumerate(zip(self.accepted_at, self.drafted_at))])
            metric("specdraft_time_per_output_token_seconds", "histogram",
                   "Per request: wall time from prefill to last token / tokens generated.", self.tpot.samples())
            metric("specdraft_batch_size", "histogram", "Per batched step: sequences in the target's pass.",
                   self.batch_size.samples())
            metric("specdraft_batch_draft_tokens", "histogram",
                   "Per batched step: draft tokens chosen in all (0: speculation stepped aside).",
                   self.batch_drafted.samples())
            metric("specdraft_batch_goodput_tokens_per_second", "histogram",
                   "Per batched step: tokens committed / its time.", self.batch_goodput.samples())
            widths = sorted(self.pass_seconds)
            metric("specdraft_target_pass_seconds", "summary",
                   "Per batched step: the target pass's seconds, by its width in tokens (what serving passes cost).",
                   [(f'_sum{{width="{w}"}}', self.pass_seconds[w][0]) for w in widths]
                   + [(f'_count{{width="{w}"}}', self.pass_seconds[w][1]) for w in widths])
            metric("specdraft_queue_depth", "gauge", "Requests waiting for the engine.", [("", totals["queue_depth"])])
            metric("specdraft_requests_running", "gauge", "Requests the engine is generating now.",
                   [("", totals["requests_running"])])
            if self._kv_cache is not None:
                reserved, budget = self._kv_cache()
                metric("specdraft_kv_cache_reserved_bytes", "gauge",
                       "KV cache reserved by the batch's sequences (prompt + max_tokens each).", [("", reserved)])
                if budget is not None:
                    metric("specdraft_kv_cache_budget_bytes", "gauge", "The KV budget the batch admits within.",
                           [("", budget)])
            return "\n".join(lines) + "\n"
