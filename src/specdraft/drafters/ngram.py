"""The `ngram` drafter (prompt lookup): propose what followed the last n tokens earlier on.

The last n tokens of the committed sequence (n from `max_n` down to `min_n`) are looked up in
an index of every earlier n-gram of the prompt and the output. No model runs, so a draft costs
next to nothing (c ≈ 0). The proposal is deterministic (`q_draft = None`): the verifier accepts
a token x with probability p(x) and otherwise draws from p with x removed, which keeps the
output exactly the target's.

- Chain (`ctx.tree_branch == 1`): the tokens that followed the most recent earlier occurrence
  of the longest matching tail.
- Tree (`ctx.tree_branch > 1`): the continuations of every remembered occurrence of every
  matching tail, merged into a trie. Each n that matches is one empirical distribution over its
  remembered occurrences; the levels are mixed with equal weight (a start that matches at
  several n, i.e. a longer match, collects weight from each), so a node's score is the weight of
  the occurrences whose continuation passes through it: the product of the empirical
  probabilities along its path. The best `k` nodes are kept best first (score, then depth, then
  priority: longer match, more recent), at most `tree_branch` children per node and at most
  `ctx.max_depth` deep, so siblings come likeliest first and every node comes after its parent.

The index is updated incrementally: each committed token adds one start per n to a list of at
most `keep` (the most recent), so a step costs O(max_n · keep) however long the sequence is.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.errors import SpecdraftError
from specdraft.tree import grow_best_first

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 2  # one-token matches propose often and are mostly wrong (measured: README)
DEFAULT_KEEP = 4  # occurrences remembered per n-gram (the tree's candidates; a chain uses the last)


class NgramIndex:
    """Where each n-gram of a growing sequence last ended, for n in [min_n, max_n].

    `follow[n][gram] = [i, ...]` lists the continuation starts of the last `keep` occurrences,
    oldest first: `tokens[i - n : i] == gram` and `tokens[i]` exists.
    """

    def __init__(self, max_n: int, min_n: int, keep: int = DEFAULT_KEEP) -> None:
        self.max_n, self.min_n, self.keep = max_n, min_n, keep
        self.tokens: list[int] = []
        self.follow: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens; every n-gram that now has a continuation is indexed."""
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        tokens, keep = self.tokens, self.keep
        for i in range(max(start, 1), len(tokens)):  # position i gained its token: grams ending before it
            for n, table in self.follow.items():
                if i >= n:
                    gram = tuple(tokens[i - n : i])
                    starts = table.get(gram)
                    if starts is None:
                        table[gram] = [i]
                    else:
                        starts.append(i)
                        if len(starts) > keep:
                            del starts[0]

    def _matches(self) -> list[tuple[int, list[int]]]:
        """(n, starts) for every n whose tail occurred before, longest n first."""
        tokens, follow = self.tokens, self.follow
        found = []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            starts = follow[n].get(tuple(tokens[-n:]))
            if starts:
                found.append((n, starts))
        return found

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the longest matching tail, and that match's n (0: none)."""
        matches = self._matches()
        if not matches:
            return [], 0
        n, starts = matches[0]
        return self.tokens[starts[-1] : starts[-1] + k], n

    def lookup_tree(self, k: int, branch: int, depth: int) -> tuple[list[int], list[int], list[float], int]:
        """At most `k` nodes merging the continuations of every remembered match (module doc): tokens,
        parents (-1: the root), scores (the share of the matches' weight through each node) and the
        longest match's n (0: none). At most `branch` children per node, at most `depth` deep;
        ordered best first, so siblings come likeliest first."""
        matches = self._matches()
        if not matches or k < 1 or depth < 1:
            return [], [], [], 0
        weights: dict[int, float] = {}  # start -> weight (sums to 1); insertion order = priority
        for _, starts in matches:
            for start in reversed(starts):  # most recent first
                weights[start] = weights.get(start, 0.0) + 1.0 / (len(starts) * len(matches))
        root = _Branch(-1, 0)
        for rank, (start, weight) in enumerate(weights.items()):
            node = root
            for token in self.tokens[start : start + depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Branch(token, rank)
                child.weight += weight
                node = child

        def children(node: _Branch, level: int, score: float):
            best = sorted(node.children.values(), key=lambda c: (-c.weight, c.rank))[:branch]
            return [(child.token, child.weight, child) for child in best]

        tokens, parents, scores, _ = grow_best_first(root, children, k)
        return tokens, parents, scores, matches[0][0]


class _Branch:
    """A node of the merged continuations: `weight` of the occurrences through it, `rank` of the
    first (the likeliest: longest match, most recent) to reach it."""

    __slots__ = ("token", "rank", "weight", "children")

    def __init__(self, token: int, rank: int) -> None:
        self.token, self.rank, self.weight = token, rank, 0.0
        self.children: dict[int, _Branch] = {}


class NgramDrafter(Drafter):
    """Prompt lookup: the continuation of the most recent earlier occurrence of the tail, or with
    `ctx.tree_branch > 1` a tree of the continuations of several (module doc)."""

    name = "ngram"

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N, keep: int = DEFAULT_KEEP) -> None:
        if not 1 <= min_n <= max_n:
            raise SpecdraftError(f"ngram sizes need 1 <= --ngram-min <= --ngram-max; got min {min_n}, max {max_n}.")
        if keep < 1:
            raise SpecdraftError(f"ngram keep (occurrences remembered per n-gram) must be >= 1; got {keep}.")
        self.max_n, self.min_n, self.keep = max_n, min_n, keep
        self.index = NgramIndex(max_n, min_n, keep)

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L]
        self.index = NgramIndex(self.max_n, self.min_n, self.keep)
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
        device = ctx.sequence.device
        if ctx.tree_branch <= 1:
            tokens, _ = self.index.lookup(k)
            return Draft.chain(torch.tensor(tokens, dtype=torch.long, device=device))  # [≤ k]
        depth = k if ctx.max_depth is None else min(k, ctx.max_depth)
        tokens, parents, scores, _ = self.index.lookup_tree(k, ctx.tree_branch, depth)
        return Draft.tree(torch.tensor(tokens, dtype=torch.long, device=device), parents, scores=scores)  # [≤ k]
