"""`specdraft check`: prove on your own model that a drafter and its options are lossless.

Two checks, on a handful of prompts:

- **greedy**: speculative greedy output equals plain greedy output (the near-tie rule of `exactness`);
- **sampled**: the first `depth` tokens of many seeded speculative answers follow the target's exact distribution.
  That distribution comes from target passes (`target_cells`): after the prompt, the `top` likeliest tokens each
  get a cell of their own and the rest share an "other" cell; each listed token's next-token distribution is split
  the same way, and so on to `depth`. A cell's probability is the product of the warped target probabilities
  along its path (temperature, top-k, top-p, min-p and the repetition penalty applied as the engine applies them).
  The counts of every prompt are tested together (the sum of their chi-square statistics, `goodness_of_fit`),
  and the verdict states the bias it could detect: the least total variation, in every prompt's cells, that the
  test catches with probability 0.9 (`goodness_of_fit.detectable_bias`).

The same functions back the statistical tests of the engine (`tests/test_engine_statistics.py`).
"""

from __future__ import annotations

import dataclasses
from contextlib import closing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np
import torch

from specdraft.exactness import compare_greedy
from specdraft.goodness_of_fit import DEFAULT_POWER, chi_square_sf, chi_square_statistic, detectable_bias
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import SamplingParams, warp

if TYPE_CHECKING:
    from specdraft.batch_engine import BatchedDecoder
    from specdraft.engine import SpeculativeDecoder
    from specdraft.stats import GenerationStats

OTHER = -1  # a cell's token standing for every token its place does not list
END = -2  # a cell's token standing for the answer's end (an end-of-sequence token)
DEFAULT_DEPTH = 2
DEFAULT_TOP = 6
DEFAULT_ALPHA = 1e-3

# Rows [n, V] masked after each row's draft prefix (a constraint's `GrammarState.mask_rows`), or None.
Mask = Callable[[torch.Tensor, list[tuple[int, ...]]], torch.Tensor]


@dataclass
class Cells:
    """The first `depth` tokens of an answer, grouped into cells with their exact probabilities under the target.

    `paths[i]` is cell i's tokens from the first generated one, OTHER standing for any token its place does not
    list and END for the answer's end (any end-of-sequence token: the engine does not emit it); a path ends there.
    `rows` holds the warped next-token distribution after each listed prefix (# each [V]), so an answer token the
    target can never produce is known.
    """

    paths: list[tuple[int, ...]]
    probabilities: np.ndarray  # [cells]
    depth: int
    rows: dict[tuple[int, ...], torch.Tensor] = field(repr=False)  # prefix -> [V] warped distribution after it
    listed: dict[tuple[int, ...], set[int]] = field(repr=False)  # prefix -> tokens with a place of their own
    eos: frozenset[int] = frozenset()  # the target's end-of-sequence ids (one END cell for all)

    def cell_of(self, tokens: Sequence[int]) -> int | None:
        """The cell an answer's tokens fall in (an answer shorter than `depth` ended there: its END cell); None where
        the target could never have produced them (a token, or the end, of probability 0 after its prefix)."""
        prefix: tuple[int, ...] = ()
        for token in [*tokens[: self.depth], END]:
            if token == END or token in self.eos:  # the answer ended here
                return self._index.get(prefix + (END,))
            if float(self.rows[prefix][token]) <= 0:
                return None
            if token not in self.listed[prefix]:
                return self._index[prefix + (OTHER,)]
            prefix += (token,)
            if prefix in self._index:
                return self._index[prefix]
        raise AssertionError("unreachable: every path ends in a cell")

    def __post_init__(self) -> None:
        self._index = {path: i for i, path in enumerate(self.paths)}


@torch.inference_mode()
def next_distributions(target: CausalLM, prompt: Sequence[int], prefixes: list[tuple[int, ...]],
                       params: SamplingParams, mask: Mask | None = None) -> torch.Tensor:
    """The target's warped next-token distribution after `prompt` + each prefix, as the engine warps its rows
    (the repetition penalty counting the prompt and the prefix; `mask`: a constraint's). # [n, V]"""
    target.reset()
    target.prefill(torch.tensor([list(prompt[:-1])], device=target.device))
    read = target.cache_len
    rows = []
    for prefix in prefixes:
        target.truncate(read)
        block = torch.tensor([[prompt[-1], *prefix]], device=target.device)  # [1, 1 + len(prefix)]
        logits = target.forward(block, logits_to_keep=1).logits[0].float()  # [1, V]
        if mask is not None:
            logits = mask(logits, [prefix])
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool, device=logits.device)  # [1, V]
            seen[0, torch.tensor([*prompt, *prefix], device=logits.device)] = True
        rows.append(warp(logits, params, seen)[0])
    target.reset()
    return torch.stack(rows)


def target_cells(target: CausalLM, prompt: Sequence[int], params: SamplingParams, depth: int = DEFAULT_DEPTH,
                 top: int | None = DEFAULT_TOP, mask: Mask | None = None) -> Cells:
    """The cells of the first `depth` answer tokens after `prompt` and their exact probabilities (module doc):
    at each place the `top` likeliest tokens (None: every token the target can produce), an "other" cell and an
    "end" cell (every end-of-sequence token)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    eos = frozenset(target.eos_token_ids)
    ends = torch.tensor(sorted(eos), dtype=torch.long)  # [E]
    paths, probabilities, rows, listed = [], [], {}, {}
    level = [((), 1.0)]  # prefixes to expand, with their probabilities
    for place in range(depth):
        distributions = next_distributions(target, prompt, [prefix for prefix, _ in level], params, mask)  # [n, V]
        following = []
        for (prefix, mass), row in zip(level, distributions.double().cpu()):
            row = row / row.sum()  # [V]
            rows[prefix] = row
            end = float(row[ends].sum()) if len(ends) else 0.0
            if end > 0:
                paths.append(prefix + (END,))
                probabilities.append(mass * end)
            others = row.index_fill(0, ends, 0.0) if len(ends) else row  # [V] the tokens that go on
            possible = int((others > 0).sum())
            values, ids = others.topk(possible if top is None else min(top, possible))
            listed[prefix] = set(ids.tolist())
            for token, p in zip(ids.tolist(), values.tolist()):
                if place == depth - 1:
                    paths.append(prefix + (token,))
                    probabilities.append(mass * p)
                else:
                    following.append((prefix + (token,), mass * p))
            rest = max(0.0, float(others.sum() - values.sum()))
            if len(listed[prefix]) < possible and rest > 0:
                paths.append(prefix + (OTHER,))
                probabilities.append(mass * rest)
        level = following
    probabilities = np.asarray(probabilities, dtype=np.float64)
    return Cells(paths, probabilities / probabilities.sum(), depth, rows, listed, eos)


@dataclass
class DistributionCheck:
    """The verdict of the sampled check over one or more prompts (each with its own cells)."""

    samples: int  # answers drawn in all
    prompts: int
    statistic: float  # the summed chi-square statistic of every prompt
    df: int
    pvalue: float
    alpha: float
    detectable: float  # the least total variation, in every prompt's cells, caught with probability `power`
    power: float = DEFAULT_POWER
    impossible: int = 0  # answers the target could never have produced (each fails the check outright)

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.pvalue > self.alpha


def count_cells(cells: Cells, answers: Iterable[Sequence[int]]) -> tuple[np.ndarray, int]:
    """Counts per cell of `answers` (each an answer's token ids), and how many the target could never produce."""
    counts, impossible = np.zeros(len(cells.paths)), 0
    for tokens in answers:
        cell = cells.cell_of(tokens)
        if cell is None:
            impossible += 1
        else:
            counts[cell] += 1
    return counts, impossible


def distribution_verdict(tables: list[tuple[Cells, np.ndarray, int]], alpha: float = DEFAULT_ALPHA,
                         power: float = DEFAULT_POWER) -> DistributionCheck:
    """The verdict over prompts whose (cells, counts, impossible answers) are given: the chi-square statistics
    summed (independent prompts), and the bias a test of this size detects."""
    statistic, df, samples, impossible = 0.0, 0, 0, 0
    for cells, counts, bad in tables:
        total = int(counts.sum())
        if total:
            value, cell_df = chi_square_statistic(counts, cells.probabilities * total)
            statistic, df = statistic + value, df + cell_df
        samples, impossible = samples + total + bad, impossible + bad
    pvalue = chi_square_sf(statistic, df) if df else 1.0
    return DistributionCheck(samples, len(tables), statistic, df, pvalue, alpha,
                             detectable_bias(max(samples, 1), max(df, 1), alpha, power), power, impossible)


# Answers to one prompt, one per sampling (each with its seed), of at most `max_new_tokens` tokens each; given
# `enough`, an answer may stop once it holds that many tokens (the steps after them cannot change them).
Answers = Callable[..., list[list[int]]]


def answer_start(decoder: "SpeculativeDecoder", prompt: Sequence[int], sampling: SamplingParams,
                 max_new_tokens: int, enough: int | None = None, stats: "GenerationStats | None" = None) -> list[int]:
    """The tokens of one answer of at most `max_new_tokens`, stepping only until it holds `enough` (None: to its
    end): each step drafts as it would in the whole answer (the budget left is the same), so the first `enough`
    tokens have the whole answer's distribution, at the cost of the steps that made them. `stats`: filled in."""
    tokens: list[int] = []
    with closing(decoder.stream(list(prompt), sampling, max_new_tokens, stats=stats)) as events:
        for event in events:
            tokens += event.token_ids
            if enough is not None and len(tokens) >= enough:
                break
    return tokens


def single_answers(decoder: "SpeculativeDecoder") -> Answers:
    """Answers from a single-request decoder (what `generate` runs), one request after another."""
    return lambda prompt, samplings, max_new_tokens, enough=None: [
        answer_start(decoder, prompt, sampling, max_new_tokens, enough) for sampling in samplings]


def batched_answers(decoder: "BatchedDecoder", k: int | None = None) -> Answers:
    """Answers from a batched decoder (what `serve` runs), as many at a time as it holds; `k` fixed, or None: the
    goodput rule chooses each sequence's k each step."""
    from specdraft.batch_engine import BatchRequest

    return lambda prompt, samplings, max_new_tokens, enough=None: [  # a batch steps each answer to its end
        completion.token_ids for completion in decoder.generate_all(
            [BatchRequest(list(prompt), sampling, max_new_tokens, k=k) for sampling in samplings])]


def check_distribution(target: CausalLM, answers: Answers, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       samples: int, depth: int = DEFAULT_DEPTH, top: int | None = DEFAULT_TOP,
                       alpha: float = DEFAULT_ALPHA, room: int = 2, seed: int = 0,
                       mask: Mask | None = None) -> DistributionCheck:
    """Draw `samples` answers per prompt (`answers(prompt, samplings, max_new_tokens)`: one answer per sampling,
    seeds seed, seed + 1, ...; `depth` + `room` new tokens, so drafts reach past the tested tokens) and test their
    first `depth` tokens against the target's exact distribution."""
    tables = []
    for index, prompt in enumerate(prompts):
        cells = target_cells(target, prompt, params, depth, top, mask)
        first = seed + index * samples
        samplings = [dataclasses.replace(params, seed=first + i) for i in range(samples)]
        counts, impossible = count_cells(cells, answers(prompt, samplings, depth + room, enough=depth))
        tables.append((cells, counts, impossible))
    return distribution_verdict(tables, alpha)


@dataclass
class GreedyCheck:
    """The verdict of the greedy check: prompts whose speculative answer equals plain decoding's, those that
    parted only at a numerical near-tie, and the first prompt that parted elsewhere (its index)."""

    prompts: int
    equal: int
    near_ties: int
    failed_at: int | None = None

    @property
    def passed(self) -> bool:
        return self.failed_at is None


def check_greedy(target: CausalLM, plain: Answers, speculative: Answers, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int) -> GreedyCheck:
    """Greedy speculative answers against plain ones on every prompt (`exactness.compare_greedy`)."""
    greedy = [SamplingParams()]
    equal = near_ties = 0
    for index, prompt in enumerate(prompts):
        reference = plain(prompt, greedy, max_new_tokens)[0]
        candidate = speculative(prompt, greedy, max_new_tokens)[0]
        comparison = compare_greedy(target, list(prompt), reference, candidate)
        if not comparison.acceptable:
            return GreedyCheck(len(prompts), equal, near_ties, failed_at=index)
        equal += comparison.equal
        near_ties += not comparison.equal
    return GreedyCheck(len(prompts), equal, near_ties)
