"""Statistics every generation returns with its result (no hooks needed to benchmark)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from dataclasses import dataclass, field


def peak_memory_bytes() -> int:
    """This process's peak resident memory so far.

    Linux: VmHWM of /proc/self/status (ru_maxrss would also count a parent's peak carried
    over through fork and exec); elsewhere ru_maxrss (bytes on macOS).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class GenerationStats:
    """Counts and times of one generation (or the sum of several).

    steps      target forwards after the prefill (each verifies one draft)
    drafted    draft tokens proposed; accepted: those the verifier kept (and that were emitted)
    new_tokens tokens emitted; wall_seconds: from the start of prefill to the last token
    accepted_at[i] / drafted_at[i]: acceptance counts per draft position i (a tree: per depth i + 1,
               drafted when the tree reached that depth, accepted when its accepted path did)
    path_per_step: the accepted draft tokens of each step, as indices into its draft (a chain: 0 .. a-1)
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, taken from a prompt read before instead of read (`prefix_cache`)
    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    k_per_step: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    source_per_step: list[str | None] = field(default_factory=list)  # who drafted each step (None: plain)
    path_per_step: list[list[int]] = field(default_factory=list)
    depth_per_step: list[int] = field(default_factory=list)  # how deep each step's draft went (a chain: k)
    forced_tokens: int = 0  # emitted without a pass: the constraint's grammar allowed nothing else
    mask_seconds: float = 0.0  # computing the constraint's masks (within draft and verify time)

    @property
    def acceptance_rate(self) -> float | None:
        """α: accepted / drafted (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_committed_per_step(self) -> float | None:
        """τ: tokens emitted per target step."""
        return self.new_tokens / self.steps if self.steps else None

    @property
    def mean_k(self) -> float | None:
        """Mean draft tokens per step (what a fixed or `auto` k drafted)."""
        return sum(self.k_per_step) / len(self.k_per_step) if self.k_per_step else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def other_seconds(self) -> float:
        """Wall time spent neither prefilling, drafting nor verifying (sampling, bookkeeping, text)."""
        return max(self.wall_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds, 0.0)

    def record_step(self, k: int, num_accepted: int, source: str | None = None, path: list[int] | None = None,
                    depth: int | None = None, draft_seconds: float = 0.0, verify_seconds: float = 0.0) -> None:
        """Count one verification step in which `source` drafted `k` tokens (a tree: `depth` deep) and
        `num_accepted` were emitted (those at `path`; a chain: the first ones), drafting and verifying in the
        times given."""
        depth = k if depth is None else depth
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.steps += 1
        self.drafted += k
        self.accepted += num_accepted
        self.k_per_step.append(k)
        self.accepted_per_step.append(num_accepted)
        self.source_per_step.append(source)
        self.path_per_step.append(list(path[:num_accepted]) if path is not None else list(range(num_accepted)))
        self.depth_per_step.append(depth)
        for counts in (self.accepted_at, self.drafted_at):
            if len(counts) < depth:
                counts.extend([0] * (depth - len(counts)))
        for i in range(depth):
            self.drafted_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def merge(self, other: "GenerationStats") -> "GenerationStats":
        """The sum of two runs' statistics (e.g. over `--n` samples)."""
        merged = GenerationStats()
        for name in ("steps", "drafted", "accepted", "new_tokens", "prompt_tokens", "cached_prompt_tokens", "wall_seconds",
                     "prefill_seconds", "draft_seconds", "verify_seconds", "forced_tokens", "mask_seconds"):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_at", "drafted_at"):
            a, b = getattr(self, name), getattr(other, name)
            width = max(len(a), len(b))
            setattr(merged, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width)])
        merged.k_per_step = self.k_per_step + other.k_per_step
        merged.accepted_per_step = self.accepted_per_step + other.accepted_per_step
        merged.source_per_step = self.source_per_step + other.source_per_step
        merged.path_per_step = self.path_per_step + other.path_per_step
        merged.depth_per_step = self.depth_per_step + other.depth_per_step
        return merged

    def by_source(self) -> dict[str, dict[str, int]]:
        """Steps, drafted and accepted per draft source (e.g. `ngram` and `model` of `ngram+model`)."""
        table: dict[str, dict[str, int]] = {}
        for source, k, accepted in zip(self.source_per_step, self.k_per_step, self.accepted_per_step):
            row = table.setdefault(source or "none", {"steps": 0, "drafted": 0, "accepted": 0})
            row["steps"] += 1
            row["drafted"] += k
            row["accepted"] += accepted
        return table

    def to_dict(self) -> dict:
        """The JSON form used by `--json`, the benchmark and the server."""
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_committed_per_step": self.mean_committed_per_step,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
            "accepted_at": list(self.accepted_at),
            "drafted_at": list(self.drafted_at),
            "mean_k": self.mean_k,
            "k_per_step": list(self.k_per_step),
            "depth_per_step": list(self.depth_per_step),
            "path_per_step": [list(path) for path in self.path_per_step],
            "by_source": self.by_source(),
            "forced_tokens": self.forced_tokens,
            "mask_seconds": self.mask_seconds,
        }
