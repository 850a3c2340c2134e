"""Token trees: the shape of a tree draft, compiled once into depths, ancestors, attention and paths.

A draft of n tokens is a tree hanging off the last committed token (the root). Token i's
parent is `parents[i]`: -1 for the root, else an earlier index (`parents[i] < i`), so the
tokens are in topological order. A chain is the tree whose parents are i - 1. Siblings are
tried in index order by the sampled verifier, so a drafter lists its likelier guesses first.

Worked example: tokens [a, b, c, d], parents [-1, -1, 0, 0]

    root ── a ── c
        │    └── d
        └── b

depth [1, 1, 2, 2]; sibling rank [0, 1, 0, 1]; verification rows: row 0 predicts after the
root, row i + 1 after token i; the path to d is [0, 3]; d attends to the committed tokens,
the root, a and itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import count
from typing import Callable, Iterable, Sequence

import torch

from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class TreeLayout:
    """A tree's shape as tensors (on the device of its tokens) and host lists."""

    parents: tuple[int, ...]  # parent index per token, -1 = the root
    depth: torch.Tensor  # [n] int64: 1 for children of the root
    ancestors: torch.Tensor  # [n, n] bool: ancestors[i, j] = token j is token i or one of its ancestors
    by_rank: tuple[torch.Tensor, ...]  # token indices with sibling rank r (r-th child of its parent), r = 0, 1, ..
    height: int  # the deepest token's depth

    @staticmethod
    def from_parents(parents: Sequence[int], device: torch.device | str = "cpu") -> "TreeLayout":
        """Compile a parent list (validated: every parent earlier than its child)."""
        parents = tuple(int(p) for p in parents)
        n = len(parents)
        depth = [0] * n
        rank = [0] * n
        children: dict[int, int] = {}
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise SpecdraftError(f"Tree token {i} has parent {parent}; a parent must be -1 (the root) or an "
                                     "earlier token.")
            depth[i] = 1 if parent < 0 else depth[parent] + 1
            rank[i] = children.get(parent, 0)
            children[parent] = rank[i] + 1
            if parent >= 0:
                ancestors[i] = ancestors[parent]
            ancestors[i, i] = True
        by_rank = tuple(torch.tensor([i for i in range(n) if rank[i] == r], dtype=torch.long, device=device)
                        for r in range(max(rank, default=-1) + 1))
        return TreeLayout(parents, torch.tensor(depth, dtype=torch.long, device=device), ancestors.to(device), by_rank,
                          max(depth, default=0))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def width(self) -> int:
        """The most children any token (or the root) has: 1 for a chain."""
        return len(self.by_rank)

    @property
    def parent_rows(self) -> torch.Tensor:
        """[n] the verification row each token is judged by: its parent's (row 0 is the root)."""
        return torch.tensor(self.parents, dtype=torch.long, device=self.depth.device) + 1

    def is_leaf(self, node: int) -> bool:
        """Whether `node` has no children (-1, the root, is a leaf only of an empty tree)."""
        return node not in self.parents

    def rows_ancestors(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over the verification rows (root, then tokens): which rows' tokens
        each row's prefix holds (the root's own token, its ancestors, itself)."""
        n = self.size
        rows = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=self.depth.device)
        rows[:, 0] = True
        rows[1:, 1:] = self.ancestors
        return rows

    def path(self, node: int) -> list[int]:
        """Tokens from the root's child down to `node` (empty for the root, -1)."""
        return path_to(node, self.parents)

    def block_attention(self, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and visibility for one pass over `prefix` plain tokens followed by the tree.

        The tree hangs off the last prefix token. Returns `offsets[T]` (position of each fed
        token relative to the first, T = prefix + n) and `visible[T, T]` (query row may attend
        to key column within the block; everything already in the cache is visible to all).
        """
        n, device = self.size, self.depth.device
        offsets = torch.cat([torch.arange(prefix, device=device), prefix - 1 + self.depth])  # [T]
        visible = torch.ones(prefix + n, prefix + n, dtype=torch.bool, device=device).tril_()  # [T, T]
        visible[prefix:, prefix:] = self.ancestors
        return offsets, visible


def path_to(node: int, parents: Sequence[int]) -> list[int]:
    """The indices from the root's child down to `node` in a parent list (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def grow_best_first(root: object, children: Callable[[object, int, float], Iterable[tuple[int, float, object]]],
                    limit: int) -> tuple[list[int], list[int], list[float], list[object]]:
    """Grow a tree of at most `limit` tokens below `root`, best first.

    `children(node, depth, score)` lists a node's candidate children as (token, score, node),
    likeliest first; a child's score must not exceed its parent's (e.g. the product of
    probabilities along the path), so every token is kept after its parent. Ties go to the
    shallower token, then to the one offered first. Returns the tokens, their parents (-1: the
    root), scores and nodes, in the order kept: topological, siblings likeliest first.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    nodes: list[object] = []
    order = count()
    frontier: list[tuple[float, int, int, int, int, object]] = []  # heap: (-score, depth, tie, parent, token, node)

    def offer(node: object, index: int, depth: int, score: float) -> None:
        for token, child_score, child in children(node, depth, score):
            heappush(frontier, (-child_score, depth + 1, next(order), index, token, child))

    offer(root, -1, 0, 1.0)
    while frontier and len(tokens) < limit:
        negative, depth, _, parent, token, node = heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        scores.append(-negative)
        nodes.append(node)
        offer(node, len(tokens) - 1, depth, -negative)
    return tokens, parents, scores, nodes
