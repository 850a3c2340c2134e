"""EAGLE-2's dynamic draft tree, for any drafter that scores a level of nodes in one pass.

Each level, every frontier node offers its `ctx.tree_branch` likeliest next tokens; a
candidate's score is the product of the drafter's probabilities along its path (its
estimate that the target accepts it). The best `tree_branch` new candidates scoring at least
`min_confidence` are fed to the drafter together (one pass, tree attention: each sees the
committed tokens, its fed ancestors and itself) and become the next frontier. At the end the
`budget` best candidates over all levels form the tree: scores never rise along a path, so
the choice keeps every chosen node's parent.

Greedy, the children are the drafter's top choices (q_draft None: point masses). Sampling,
the tree is the sampled chain with leaf siblings: each level's one expanded node is the drawn
child of the level above (drawn from the drafter's warped distribution q; its q row goes to
the verifier, which accepts it with min(1, p/q) like a chain token), and its siblings are the
top choices besides it (one-hot q rows: point masses tried after it, a second chance where the
drawn token is rejected). The drawn child is always tried first among its siblings: the later
ones depend on it, which multi-draft rejection allows only for proposals tried after it.
Every drawn child is kept (choosing one by its drawn value would bias it away from q), and
siblings go to the shallowest levels, which every step passes through, as long as each level
still to come keeps room for its drawn node. So a sampled tree is as deep as the chain the same
budget allows, and accepts at least as much as that chain. The draft lists the drawn chain
first and then the siblings, likeliest first, so a cut of its tail (`Draft.must_keep`) drops
only point masses, which any rule may choose: the sampled draw stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.sampling import sample, warp
from specdraft.tree import path_to

# expand(frontier, block, depth, visible, parents) -> logits [m, V]: feed the frontier's tokens
# (`block` [1, m], pool indices `frontier`, all at `depth`) with `visible` [m, S] over every fed
# tree token; `parents` is the pool's parent list (-1: the root).
Expand = Callable[[list[int], torch.Tensor, int, torch.Tensor, list[int]], torch.Tensor]


@dataclass
class GrownTree:
    """A grown tree: the draft, and for each of its tokens the slot it was fed at (None: never fed)."""

    draft: Draft
    fed_slots: list[int | None]


def ranking(logits: torch.Tensor, params, seen_rows: torch.Tensor | None) -> torch.Tensor:
    """[m, V] the probabilities a tree ranks candidates by: the warped distribution, or under
    greedy decoding the plain softmax (greedy warps to a point mass)."""
    if params.greedy and params.repetition_penalty == 1.0:
        return logits.float().softmax(-1)
    probs = warp(logits, params, seen_rows)
    return logits.float().softmax(-1) if params.greedy else probs


def grow_dynamic_tree(root_logits: torch.Tensor, expand: Expand, ctx: DraftContext, budget: int,
                      min_confidence: float) -> GrownTree:
    """Grow a tree of up to `budget` tokens from the drafter's logits after the last committed token. # root_logits: [1, V]"""
    params, branch = ctx.params, ctx.tree_branch
    max_depth = min(budget, ctx.max_depth or budget)
    logits = root_logits
    device = root_logits.device
    seen_rows = ctx.seen.unsqueeze(0) if ctx.seen is not None else None  # [1, V]
    # The candidate pool (host lists, a few dozen entries): token, parent (pool index, -1 root), score, depth.
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    depths: list[int] = []
    fed: list[int] = []  # pool indices in the order they were fed
    drawn_from: dict[int, torch.Tensor] = {}  # pool index -> the q row it was drawn from (sampling)
    frontier, frontier_scores = [-1], [1.0]
    for depth in range(1, max_depth + 1):
        if ctx.grammar is not None:  # each frontier row masked after its own path
            logits = ctx.constrain(logits, [[tokens[i] for i in path_to(node, parents)] for node in frontier])
        probs = ranking(logits, params, seen_rows)  # [m, V]
        if params.greedy:
            top_probs, top_tokens = probs.topk(branch, dim=-1)  # [m, B]
        else:  # one frontier node (m = 1): column 0 drawn from q, then the likeliest others
            drawn = sample(probs, ctx.generator).unsqueeze(-1)  # [1, 1]
            levels_to_come = max_depth - depth  # each keeps one node for its drawn child
            siblings = max(0, min(branch - 1, budget - len(tokens) - 1 - levels_to_come))
            rest_probs, rest_tokens = probs.scatter(-1, drawn, -1.0).topk(siblings, dim=-1)  # [1, A]
            top_tokens = torch.cat([drawn, rest_tokens], dim=-1)  # [1, 1 + A]
            top_probs = torch.cat([probs.gather(-1, drawn), rest_probs.clamp_min(0.0)], dim=-1)  # [1, 1 + A]
        width = top_probs.shape[-1]  # candidates per frontier row (B, or fewer where the budget is smaller)
        level = (torch.tensor(frontier_scores).unsqueeze(-1) * top_probs.cpu()).flatten()  # [m * B]
        top_tokens = top_tokens.flatten().tolist()
        new_nodes = []
        for flat in level.argsort(descending=True).tolist():
            if level[flat] <= 0:  # outside the warped support: the target could never accept it
                break
            if not params.greedy and flat % width == 0:
                drawn_from[len(tokens)] = probs[flat // width]
            new_nodes.append(len(tokens))
            tokens.append(top_tokens[flat])
            parents.append(frontier[flat // width])
            scores.append(float(level[flat]))
            depths.append(depth)
        if params.greedy:
            frontier = [node for node in new_nodes[:branch] if scores[node] >= min_confidence]
        else:  # the drawn child goes on (a choice by position, not by its value)
            frontier = [node for node in new_nodes if node in drawn_from and scores[node] >= min_confidence]
        if depth == max_depth or not frontier:
            break
        frontier_scores = [scores[node] for node in frontier]
        fed += frontier
        slot = {node: i for i, node in enumerate(fed)}
        visible = torch.zeros(len(frontier), len(fed), dtype=torch.bool)  # [m, S] over the fed tree tokens
        for row, node in enumerate(frontier):
            visible[row, [slot[i] for i in path_to(node, parents)]] = True
        block = torch.tensor([tokens[i] for i in frontier], device=device).unsqueeze(0)  # [1, m]
        logits = expand(frontier, block, depth, visible.to(device), parents)  # [m, V]
        if ctx.seen is not None:  # each frontier row has also seen its own path
            seen_rows = ctx.seen.unsqueeze(0).repeat(len(frontier), 1)  # [m, V]
            for row, node in enumerate(frontier):
                seen_rows[row, [tokens[i] for i in path_to(node, parents)]] = True
    # The tree: greedy, the `budget` best candidates, parents first (ties: shallower first); sampling, every
    # candidate: the drawn chain root down (so each drawn child is tried before its siblings), then the siblings,
    # likeliest first (point-mass leaves: a cut may drop any of them, see Draft.must_keep).
    ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))
    chosen: list[int] = []
    if params.greedy:
        for node in ranked[:budget]:
            if parents[node] < 0 or parents[node] in chosen:
                chosen.append(node)
    else:
        chosen = sorted(drawn_from, key=lambda i: depths[i]) + [i for i in ranked if i not in drawn_from]
    position = {node: i for i, node in enumerate(chosen)}
    fed_slot = {node: slot for slot, node in enumerate(fed)}
    draft_tokens = torch.tensor([tokens[i] for i in chosen], dtype=torch.long, device=device)  # [n]
    q_draft = None  # [n, V]: drawn children's q rows, one-hot rows for the rest
    if any(node in drawn_from for node in chosen):
        q_draft = torch.zeros(len(chosen), probs.shape[-1], device=device)
        q_draft[torch.arange(len(chosen), device=device), draft_tokens] = 1.0
        for i, node in enumerate(chosen):
            if node in drawn_from:
                q_draft[i] = drawn_from[node]
    draft = Draft.tree(draft_tokens, [position[parents[i]] if parents[i] >= 0 else -1 for i in chosen], q_draft,
                       [scores[i] for i in chosen], drawn=None if params.greedy else len(drawn_from))
    return GrownTree(draft, [fed_slot.get(node) for node in chosen])
