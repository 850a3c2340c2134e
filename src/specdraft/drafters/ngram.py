"""The `ngram` drafter (prompt lookup): propose what followed the last n tokens earlier on.

The last n tokens of the committed sequence (n from `max_n` down to `min_n`) are looked up in
an index of every earlier n-gram of the prompt and the output; the tokens that followed the
most recent earlier occurrence are the proposal. No model runs, so a draft costs next to
nothing (c ≈ 0). The proposal is deterministic (`q_draft = None`): the verifier accepts a
token x with probability p(x) and otherwise draws from p with x removed, which keeps the
output exactly the target's.

The index is updated incrementally: each committed token adds one entry per n, so a step
costs O(max_n) dictionary operations however long the sequence is.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.errors import SpecdraftError

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 2  # one-token matches propose often and are mostly wrong (measured: README)


class NgramIndex:
    """Where each n-gram of a growing sequence last ended, for n in [min_n, max_n].

    `follow[n][gram] = i` means `tokens[i - n : i] == gram` and `tokens[i]` exists (the
    continuation starts at i); later occurrences overwrite earlier ones.
    """

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens; every n-gram that now has a continuation is indexed."""
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        tokens = self.tokens
        for i in range(max(start, 1), len(tokens)):  # position i gained its token: grams ending before it
            for n, table in self.follow.items():
                if i >= n:
                    table[tuple(tokens[i - n : i])] = i

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the longest matching tail, and that match's n (0: none)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.follow[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k], n
        return [], 0


class NgramDrafter(Drafter):
    """Prompt lookup: the continuation of the most recent earlier occurrence of the tail (module doc)."""

    name = "ngram"

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise SpecdraftError(f"ngram sizes need 1 <= --ngram-min <= --ngram-max; got min {min_n}, max {max_n}.")
        self.max_n, self.min_n = max_n, min_n
        self.index = NgramIndex(max_n, min_n)

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L]
        self.index = NgramIndex(self.max_n, self.min_n)
        self.index.extend(prompt.tolist())

    def _catch_up(self, sequence: torch.Tensor) -> None:  # sequence: [L], grows by committed tokens only
        known = len(self.index.tokens)
        if sequence.shape[0] > known:
            self.index.extend(sequence[known:].tolist())

    def match_length(self, ctx: DraftContext) -> int:
        """n of the longest tail that occurred before (0: none)."""
        self._catch_up(ctx.sequence)
        return self.index.lookup(1)[1]

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        return self.name if self.name not in declined and self.match_length(ctx) else None

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        self._catch_up(ctx.sequence)
        tokens, _ = self.index.lookup(k)
        return Draft.chain(torch.tensor(tokens, dtype=torch.long, device=ctx.sequence.device))  # [≤ k]
