"""Logits to probabilities: the only place warping happens.

The same `warp` turns the target's logits into `p_target` and the draft's logits into
`q_draft`, so the two distributions are always warped identically. The order follows
Hugging Face's logits processors: repetition penalty, then temperature, top-k, top-p, min-p.

Temperature 0 means greedy: the distribution is a point mass on the (penalised) argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen from logits; identical for the target and the draft.

    temperature: 0 for greedy decoding, otherwise > 0.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set whose probability reaches top_p (1 = off).
    min_p: drop tokens below min_p times the top probability (0 = off).
    repetition_penalty: > 1 discourages tokens already in the sequence (1 = off).
    seed: seeds the `torch.Generator` that drives every random choice of a run.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecdraftError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if 0 < self.temperature < 1e-4:
            raise SpecdraftError(f"temperature {self.temperature} is too small to divide logits by; use 0 for greedy.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SpecdraftError(f"top-k must be a whole number (0 = off), got {self.top_k!r}.")
        if self.top_k < 0:
            raise SpecdraftError(f"top-k must be >= 0 (0 = off), got {self.top_k}.")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecdraftError(f"top-p must be in (0, 1] (1 = off), got {self.top_p}.")
        if not (0.0 <= self.min_p <= 1.0):
            raise SpecdraftError(f"min-p must be in [0, 1] (0 = off), got {self.min_p}.")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SpecdraftError(f"repetition penalty must be > 0 (1 = off), got {self.repetition_penalty}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with `seed`, on `device`: every random draw of a run comes from it."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed)
        return generator


def apply_repetition_penalty(
    logits: torch.Tensor,  # [T, V]
    seen: torch.Tensor,  # [T, V] bool: row t marks the tokens in row t's prefix
    penalty: float,
) -> torch.Tensor:
    """Hugging Face's rule: a seen token's logit is divided by `penalty` if positive, else multiplied."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def seen_tokens_per_row(
    context_seen: torch.Tensor,  # [V] bool: tokens of the committed prefix
    block: torch.Tensor,  # [T] the tokens fed in this pass; row t predicts the token after block[t]
    ancestors: torch.Tensor | None = None,  # [T, T] bool: row t's prefix holds block[j]; None = a chain
) -> torch.Tensor:
    """Per-row prefix membership for a pass over `block`: row t has seen the context and the
    block tokens on its own path (a chain: block[: t + 1]; a tree: its ancestors and itself).

    Example: context {a}, block [b, c] -> row 0 saw {a, b}, row 1 saw {a, b, c}.
    """
    length = block.shape[0]
    if ancestors is None:
        ancestors = torch.ones(length, length, dtype=torch.bool, device=block.device).tril_()
    rows, columns = ancestors.nonzero(as_tuple=True)
    seen = context_seen.unsqueeze(0).repeat(length, 1)  # [T, V]
    seen[rows, block[columns]] = True
    return seen


def target_rows(
    logits: torch.Tensor,  # [k + 1, V] the target's rows of a verification pass
    params: "SamplingParams",
    seen: torch.Tensor | None,  # [V] bool: tokens of the committed prefix (repetition penalty); None without one
    block: torch.Tensor,  # [k + 1] the tokens whose rows these are: the last committed token, then the draft's
    ancestors: torch.Tensor | None = None,  # [k + 1, k + 1] bool for a tree pass; None = a chain
) -> torch.Tensor:
    """What a draft is verified against: the logits themselves for plain greedy decoding (only their argmax
    counts), else each row's warped distribution, the repetition penalty counting the tokens on its own path."""
    if params.greedy and seen is None:
        return logits
    rows_seen = None if seen is None else seen_tokens_per_row(seen, block, ancestors)  # [k + 1, V]
    return warp(logits, params, rows_seen)  # [k + 1, V]


def warp(
    logits: torch.Tensor,  # [T, V]
    params: SamplingParams,
    seen: torch.Tensor | None = None,  # [T, V] bool, needed when repetition_penalty != 1
) -> torch.Tensor:
    """Return the warped distribution `probs[T, V]` (float32) that tokens are drawn from."""
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("warp needs `seen` when a repetition penalty is set")
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly more likely already reach top_p; the top one always stays.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(-1, keepdim=True).values  # [T, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(
    probs: torch.Tensor,  # [T, V] non-negative, each row with positive mass (need not sum to 1)
    generator: torch.Generator,
) -> torch.Tensor:
    """One token per row drawn from `probs` with `generator`: `[T]` int64.

    Inverse CDF with one uniform per row: the first token whose cumulative mass reaches
    u * total, u in (0, 1]. A token of probability 0 is never drawn (its cumulative mass
    equals the one before it, which is already below the threshold), and the sums run in
    float64, so each token's drawn mass is off by at most ~1e-16 from its own. Measured on a
    151,936-token vocabulary (2 threads): 0.4 ms a row, against 3.1 ms for torch.multinomial.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)  # [T, V]
    uniform = 1.0 - torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64,
                               device=probs.device)  # [T, 1] in (0, 1]
    return torch.searchsorted(cdf, uniform * cdf[:, -1:]).squeeze(-1)
