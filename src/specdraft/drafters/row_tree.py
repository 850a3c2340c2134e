"""A best-first tree over independent rows: for drafters whose one pass gives a distribution for every depth that
does not read the tokens drawn above it (`medusa`'s heads, a `dflash` block's rows; row d for the token d + 1 after
the last committed one).

A node's score is the product of its path's row probabilities; `tree.grow_best_first` keeps the `budget` likeliest
nodes, each at most `depth` deep. Greedy, a node's children are its row's `tree_branch` top choices. Sampling, its
first child is drawn from q (its row) and placed by its parent's score, not its own, so it is always kept once its
parent is (its place is decided before its value is known); the others are top choices tried after it as point
masses. Under a constraint each node's row is masked after the node's own path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.drafters.feature import head_distributions
from specdraft.sampling import sample
from specdraft.tree import grow_best_first


@dataclass(frozen=True)
class _Node:
    """A tree node's own probability product (its heap priority may differ) and its q row, if drawn."""

    score: float
    q_row: torch.Tensor | None = None  # [V]
    path: tuple[int, ...] = ()  # its tokens from the root, for a constraint's mask


def grow_row_tree(logits: torch.Tensor, ctx: DraftContext, budget: int, depth: int) -> Draft:
    """A tree of up to `budget` tokens at most `depth` deep over the rows `logits` (# [depth, V]; see the module
    doc), `ctx.tree_branch` children a node at most."""
    branch, greedy = ctx.tree_branch, ctx.params.greedy
    probs = head_distributions(logits, ctx)  # [depth, V]
    top_probs, top_tokens = probs.topk(branch, dim=-1)  # [depth, B]
    top_probs, top_tokens = top_probs.tolist(), top_tokens.tolist()

    def row_of(node: _Node, level: int) -> tuple[torch.Tensor, list[int], list[float]]:
        """What a node's children are drawn from ([V]) and its likeliest children: the row, or under a constraint
        that row masked after the node's own path."""
        if ctx.grammar is None:
            return probs[level], top_tokens[level], top_probs[level]
        row = head_distributions(ctx.constrain(logits[level : level + 1], [list(node.path)]), ctx)[0]  # [V]
        values, ids = row.topk(branch)
        return row, ids.tolist(), values.tolist()

    def children(node: _Node, level: int, priority: float):
        if level >= depth:
            return []
        row, likeliest, likeliest_probs = row_of(node, level)
        offered = []
        if not greedy:  # first child drawn from q_{level+1}, placed by its parent's score, not its own
            drawn = int(sample(row.unsqueeze(0), ctx.generator)[0])
            offered.append((drawn, priority, _Node(node.score * float(row[drawn]), row, node.path + (drawn,))))
        for token, p in zip(likeliest, likeliest_probs):
            if len(offered) < branch and p > 0 and all(token != other for other, *_ in offered):
                offered.append((token, node.score * p, _Node(node.score * p, None, node.path + (token,))))
        return offered

    tokens, parents, _, nodes = grow_best_first(_Node(1.0), children, budget)
    device = ctx.sequence.device
    draft_tokens = torch.tensor(tokens, dtype=torch.long, device=device)  # [n]
    q_draft = None  # [n, V]: drawn children's q rows, one-hot rows for the rest
    if not greedy:
        q_draft = torch.zeros(len(tokens), probs.shape[-1], device=device)
        q_draft[torch.arange(len(tokens), device=device), draft_tokens] = 1.0
        for i, node in enumerate(nodes):
            if node.q_row is not None:
                q_draft[i] = node.q_row
    return Draft.tree(draft_tokens, parents, q_draft, scores=[node.score for node in nodes])
