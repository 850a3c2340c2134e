"""What speculation can gain on this machine: the target's pass cost by width, the draft's cost per
token, and the limits they run against.

A decoding step of one token reads every weight once, so its time is about the weights' bytes over
the memory bandwidth. A verify pass over t tokens reads the same bytes but does t times the
multiply-adds; where the cores are fast next to the memory (a GPU, a CPU with AMX) the extra
tokens are nearly free, where they are not (2 CPU cores on bf16 dot products) each one adds a
fixed slope. That slope, not only the draft's cost, decides which k pays:

    speedup(α, k) = τ(α, k) / (k·c + V(k + 1) / V(1))

with V(t) the target's measured time for a pass over t tokens and c the draft's time per token
over V(1) (see `theory.expected_speedup`). `measure_costs` times V(t) and the draft on random
tokens after a context of `context` tokens (round-robin over the widths, so drift on a shared
machine spreads over all of them alike) and the memory's streaming rate before and after (on a
shared host it moved by up to 1.7x between runs a minute apart); `CostReport` turns them
into the rates a user can check against the hardware and the speedups to expect by α.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Iterator, Mapping, Sequence

import torch

from specdraft.analysis.theory import expected_speedup, expected_tau
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.run import sync_device

DEFAULT_WIDTHS = tuple(range(1, 9))
DEFAULT_CONTEXT = 300  # cached tokens before each timed pass (a prompt and some output)
DEFAULT_REPEATS = 7
STREAM_MB = 256  # the buffer `stream_gb_per_s` reads: far past any cache
STREAM_DRIFT_WARNING = 0.15  # a memory rate that moved more than this while timing is reported


@dataclass
class MachineCosts:
    """Measured costs (seconds are medians over the repeats)."""

    device: str
    threads: int
    context: int
    pass_seconds: dict[int, float]  # width t -> one target pass over t tokens
    draft_seconds: float | None  # one draft token (a one-token draft pass); None without a draft
    target_bytes: int  # weight bytes a target pass reads (all but the embedding table)
    target_macs: int  # multiply-adds per token in the target's linears
    stream_gb_per_s: float  # memory read rate of a plain sum over STREAM_MB, before the passes were timed
    draft_bytes: int | None = None  # weight bytes a draft pass reads
    stream_after_gb_per_s: float | None = None  # the same rate after them: a shared host's rate drifts

    @property
    def stream_drift(self) -> float:
        """How far the memory rate moved while timing, as a share of the lower reading (0 if read once)."""
        if self.stream_after_gb_per_s is None:
            return 0.0
        low, high = sorted((self.stream_gb_per_s, self.stream_after_gb_per_s))
        return high / low - 1.0

    def pass_ratio(self, width: int) -> float:
        """V(width) / V(1)."""
        return self.pass_seconds[width] / self.pass_seconds[1]

    @property
    def draft_ratio(self) -> float | None:
        """c: one draft token's time over one target step's."""
        return None if self.draft_seconds is None else self.draft_seconds / self.pass_seconds[1]

    @property
    def weights_gb_per_s(self) -> float:
        """The rate a one-token pass reads the target's weights at (compare with `stream_gb_per_s`)."""
        return self.target_bytes / self.pass_seconds[1] / 1e9

    @property
    def draft_gb_per_s(self) -> float | None:
        """The rate a one-token draft pass reads the draft's weights at."""
        if self.draft_seconds is None or self.draft_bytes is None:
            return None
        return self.draft_bytes / self.draft_seconds / 1e9

    @property
    def extra_token_seconds(self) -> float | None:
        """The slope: what each token past the first adds to a pass (least squares over the widths measured)."""
        widths = sorted(self.pass_seconds)
        if len(widths) < 2:
            return None
        times = [self.pass_seconds[w] for w in widths]
        mean_w, mean_t = statistics.fmean(widths), statistics.fmean(times)
        return (sum((w - mean_w) * (t - mean_t) for w, t in zip(widths, times))
                / sum((w - mean_w) ** 2 for w in widths))

    @property
    def extra_token_gmacs(self) -> float | None:
        """Multiply-adds per second that the slope implies (compare with the cores' peak)."""
        slope = self.extra_token_seconds
        return None if slope is None or slope <= 0 else self.target_macs / slope / 1e9

    def to_dict(self) -> dict:
        return {**asdict(self), "pass_seconds": {str(w): s for w, s in self.pass_seconds.items()},
                "weights_gb_per_s": self.weights_gb_per_s, "extra_token_seconds": self.extra_token_seconds,
                "extra_token_gmacs": self.extra_token_gmacs, "draft_ratio": self.draft_ratio,
                "draft_gb_per_s": self.draft_gb_per_s, "stream_drift": self.stream_drift}


@dataclass(frozen=True)
class Prediction:
    """The best k (0 = plain decoding) and its expected speedup at one α, for one draft cost."""

    alpha: float
    k: int
    speedup: float
    tau: float


@dataclass
class CostReport:
    """Predicted speedups by α from measured costs: with the draft model, with a free draft (c = 0, e.g.
    n-gram), and with free draft and flat passes (what the arithmetic alone would promise)."""

    costs: MachineCosts
    alphas: list[float]
    draft: list[Prediction] = field(default_factory=list)
    free: list[Prediction] = field(default_factory=list)
    flat: list[Prediction] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"costs": self.costs.to_dict(), "alphas": self.alphas,
                **{name: [asdict(p) for p in getattr(self, name)] for name in ("draft", "free", "flat")}}


def best_prediction(alpha: float, c: float, pass_ratio: dict[int, float]) -> Prediction:
    """The k among the measured widths (k + 1 ≤ the widest) with the highest expected speedup; k = 0 when
    none beats plain decoding. `pass_ratio`: width -> V(width) / V(1)."""
    best = Prediction(alpha, 0, 1.0, 1.0)
    for k in sorted(w - 1 for w in pass_ratio if w > 1):
        speedup = expected_speedup(alpha, k, c, pass_ratio[k + 1])
        if speedup > best.speedup + 1e-12:
            best = Prediction(alpha, k, speedup, expected_tau(alpha, k))
    return best


def predict(costs: MachineCosts, alphas: Sequence[float]) -> CostReport:
    """The best k and speedup per α for the measured draft, a free draft and flat passes."""
    for alpha in alphas:
        if not 0.0 <= alpha <= 1.0:
            raise SpecdraftError(f"--alpha values must be in [0, 1], got {alpha}.")
    ratios = {w: costs.pass_ratio(w) for w in costs.pass_seconds}
    flat = {w: 1.0 for w in costs.pass_seconds}
    report = CostReport(costs, list(alphas))
    for alpha in alphas:
        if costs.draft_ratio is not None:
            report.draft.append(best_prediction(alpha, costs.draft_ratio, ratios))
        report.free.append(best_prediction(alpha, 0.0, ratios))
        report.flat.append(best_prediction(alpha, 0.0, flat))
    return report


def _pass_tensors(lm: CausalLM, buffers: bool) -> Iterator[torch.Tensor]:
    """Each distinct parameter (and buffer) of `lm` a pass reads: all but the input embedding's (a pass looks
    up only its rows), those of the LM head included even where it shares the embedding's storage."""
    embedding, head = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    seen = {t.data_ptr() for t in chain(embedding.parameters(), embedding.buffers())}
    if head is not None:
        seen -= {t.data_ptr() for t in chain(head.parameters(), head.buffers())}
    for tensor in chain(lm.model.parameters(), lm.model.buffers() if buffers else ()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield tensor


def weight_bytes(lm: CausalLM) -> int:
    """Bytes of the weights a pass reads (`_pass_tensors`, packed buffers and oneDNN's opaque ones included)."""
    return sum(t.numel() * t.element_size() for t in _pass_tensors(lm, buffers=True)) + \
        sum(m.opaque_weight_bytes() for m in lm.model.modules() if hasattr(m, "opaque_weight_bytes"))


def token_macs(lm: CausalLM) -> int:
    """Multiply-adds per token in the linears: every matrix a pass reads, packed ones included. Norms and
    biases are not multiplies."""
    embedding = lm.model.get_input_embeddings()
    return sum(t.numel() for t in _pass_tensors(lm, buffers=False) if t.dim() >= 2) + \
        sum(m.num_packed_weights() for m in lm.model.modules() if hasattr(m, "num_packed_weights") and m is not embedding)


def rates_text(costs: Mapping) -> str:
    """The rates measured costs imply, in a sentence (`MachineCosts.to_dict()` form)."""
    slope, gmacs = costs.get("extra_token_seconds"), costs.get("extra_token_gmacs")
    text = (f"memory streams {costs['stream_gb_per_s']:.1f} GB/s; a one-token pass reads "
            f"{costs['target_bytes'] / 1e9:.2f} GB of weights at {costs['weights_gb_per_s']:.1f} GB/s; each further "
            f"token adds {'-' if slope is None else f'{slope * 1e3:.1f}'} ms")
    one = costs["pass_seconds"].get(1) or costs["pass_seconds"].get("1")
    if slope is not None and one:
        text += f" ({slope / one:.2f} of a one-token pass: `specdraft theory --slope`)"
    if gmacs is not None:
        text += f": {gmacs:.0f} G multiply-adds/s"
    if costs.get("draft_gb_per_s") is not None:
        text += f"; the draft reads {costs['draft_bytes'] / 1e9:.2f} GB a token at {costs['draft_gb_per_s']:.1f} GB/s"
    return text


def drift_text(costs: Mapping) -> str | None:
    """A warning when the memory rate moved more than STREAM_DRIFT_WARNING while timing, else None."""
    if costs.get("stream_drift", 0.0) <= STREAM_DRIFT_WARNING:
        return None
    return (f"The memory rate moved {costs['stream_drift']:.0%} while timing (before {costs['stream_gb_per_s']:.1f}, "
            f"after {costs['stream_after_gb_per_s']:.1f} GB/s): the host is shared or throttled, and its speed may "
            "have moved at other times too; time again and compare within one run.")


def stream_gb_per_s(device: torch.device, megabytes: int = STREAM_MB, repeats: int = 5) -> float:
    """How fast this device's memory streams: the best of `repeats` sums over a `megabytes` float32 buffer."""
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        sync_device(device)
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9


@torch.inference_mode()
def pass_seconds(lm: CausalLM, widths: Sequence[int], context: int, repeats: int,
                 generator: torch.Generator) -> dict[int, float]:
    """Median seconds of a pass over each width after `context` cached random tokens, widths taken in turn."""
    if context < 1:
        raise SpecdraftError(f"--context must be >= 1, got {context}.")
    if context + max(widths) > lm.max_context:
        raise SpecdraftError(f"--context {context} plus a pass of {max(widths)} tokens is past {lm.name}'s "
                             f"context of {lm.max_context}; lower --context.")
    vocab = min(lm.vocab_size, 32768)  # ordinary tokens, not the special ones at the top of the vocabulary
    device = lm.device
    lm.reset()
    lm.prefill(torch.randint(vocab, (1, context), generator=generator).to(device))
    timings: dict[int, list[float]] = {w: [] for w in widths}
    for repeat in range(repeats + 1):  # the first round warms up and is not kept
        for width in widths:
            tokens = torch.randint(vocab, (1, width), generator=generator).to(device)
            started = time.perf_counter()
            lm.forward(tokens, width)
            sync_device(device)
            if repeat:
                timings[width].append(time.perf_counter() - started)
            lm.truncate(context)
    lm.reset()
    return {w: statistics.median(times) for w, times in timings.items()}


def measure_costs(target: CausalLM, draft: CausalLM | None = None, widths: Sequence[int] = DEFAULT_WIDTHS,
                  context: int = DEFAULT_CONTEXT, repeats: int = DEFAULT_REPEATS, seed: int = 0) -> MachineCosts:
    """Time the target's passes over `widths` (1 must be one of them) and the draft's one-token pass."""
    widths = sorted(set(widths))
    if not widths or widths[0] != 1:
        raise SpecdraftError("--widths must include 1 (plain decoding is the baseline every width is compared with).")
    if repeats < 1:
        raise SpecdraftError(f"--repeats must be >= 1, got {repeats}.")
    generator = torch.Generator().manual_seed(seed)
    stream_before = stream_gb_per_s(target.device)
    passes = pass_seconds(target, widths, context, repeats, generator)
    draft_time = pass_seconds(draft, [1], context, repeats, generator)[1] if draft is not None else None
    return MachineCosts(device=str(target.device), threads=torch.get_num_threads(), context=context,
                        pass_seconds=passes, draft_seconds=draft_time, target_bytes=weight_bytes(target),
                        target_macs=token_macs(target), stream_gb_per_s=stream_before,
                        draft_bytes=weight_bytes(draft) if draft is not None else None,
                        stream_after_gb_per_s=stream_gb_per_s(target.device))
