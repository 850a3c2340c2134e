"""Server metrics in Prometheus' text format (no client library: a few counters and one histogram)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from specdraft.stats import GenerationStats

# Upper bounds (seconds) of the time-per-output-token histogram's buckets.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _number(value: float) -> str:
    """A sample value as Prometheus reads it: integers exactly, floats in full precision."""
    return str(value) if isinstance(value, int) else repr(float(value))


class Metrics:
    """Counts requests and generated tokens; `render` writes them out. Safe from any thread."""

    def __init__(self, queue_depth: Callable[[], int], in_flight: Callable[[], int]) -> None:
        self._lock = threading.Lock()
        self._queue_depth, self._in_flight = queue_depth, in_flight
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.cancelled = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.steps = self.drafted = self.accepted = 0
        self.accepted_at: list[int] = []
        self.drafted_at: list[int] = []
        self.tpot_buckets = [0] * len(TPOT_BUCKETS)
        self.tpot_sum, self.tpot_count = 0.0, 0

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
            self.completion_tokens += stats.new_tokens
            self.steps += stats.steps
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            for mine, theirs in ((self.accepted_at, stats.accepted_at), (self.drafted_at, stats.drafted_at)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, count in enumerate(theirs):
                    mine[i] += count
            if stats.new_tokens:
                tpot = stats.wall_seconds / stats.new_tokens
                self.tpot_sum += tpot
                self.tpot_count += 1
                for i, bound in enumerate(TPOT_BUCKETS):
                    self.tpot_buckets[i] += tpot <= bound

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
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
            metric("specdraft_generation_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
            metric("specdraft_steps_total", "counter", "Target verification steps.", [("", self.steps)])
            metric("specdraft_draft_tokens_total", "counter", "Draft tokens proposed.", [("", self.drafted)])
            metric("specdraft_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", self.accepted)])
            metric("specdraft_acceptance_rate", "gauge", "alpha: accepted / drafted since start.",
                   [("", self.accepted / self.drafted if self.drafted else 0.0)])
            metric("specdraft_mean_committed_per_step", "gauge", "tau: generated tokens / steps since start.",
                   [("", self.completion_tokens / self.steps if self.steps else 0.0)])
            metric("specdraft_position_drafted_total", "counter", "Steps whose draft reached position p (1-based).",
                   [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(self.drafted_at)])
            metric("specdraft_position_accepted_total", "counter", "Steps whose accepted path reached position p.",
                   [(f'{{position="{i + 1}"}}', n) for i, n in enumerate(self.accepted_at)])
            metric("specdraft_position_acceptance_rate", "gauge", "Acceptance at draft position p.",
                   [(f'{{position="{i + 1}"}}', a / d if d else 0.0)
                    for i, (a, d) in enumerate(zip(self.accepted_at, self.drafted_at))])
            buckets = [(f'_bucket{{le="{bound}"}}', n) for bound, n in zip(TPOT_BUCKETS, self.tpot_buckets)]
            metric("specdraft_time_per_output_token_seconds", "histogram",
                   "Per request: wall time from prefill to last token / tokens generated.",
                   [*buckets, ('_bucket{le="+Inf"}', self.tpot_count), ("_sum", self.tpot_sum),
                    ("_count", self.tpot_count)])
            metric("specdraft_queue_depth", "gauge", "Requests waiting for the engine.", [("", self._queue_depth())])
            metric("specdraft_requests_running", "gauge", "Requests the engine is generating now.",
                   [("", self._in_flight())])
            return "\n".join(lines) + "\n"
