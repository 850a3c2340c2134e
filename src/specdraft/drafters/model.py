"""The `model` drafter: a separate, smaller LM with its own KV cache drafts token by token."""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import sample, warp
from specdraft.tree import path_to


# Stop drafting once the chain's estimated survival falls below this (measured: README).
DEFAULT_MIN_CONFIDENCE = 0.35


class ModelDrafter(Drafter):
    """Draft with a small LM of the target's vocabulary, warped exactly like the target.

    The draft cache holds the committed sequence it has seen plus the draft tokens it fed;
    after each verdict it is cut back to what the target kept.

    `min_confidence` ends a proposal early: once the product of the draft's own
    probabilities for its tokens (its estimate that the whole chain survives) falls below
    it, drafting more would mostly be wasted. The stop depends only on what the draft has
    already drawn, so verification stays exact.
    """

    name = "model"

    def __init__(self, model: CausalLM, min_confidence: float = DEFAULT_MIN_CONFIDENCE) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise SpecdraftError(f"min draft confidence must be in [0, 1), got {min_confidence}.")
        self.model = model
        self.min_confidence = min_confidence
        self._fed_draft = 0  # draft tokens fed into the cache during the last proposal
        self._tree_slots: list[int | None] | None = None  # per tree token: where the cache holds it (None: unfed)

    def begin(self, prompt: torch.Tensor) -> None:
        # No prefill here: the first proposal reads the prompt, so a request (or a policy) that
        # never drafts never pays for the draft's prefill.
        self.model.reset()

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        self._tree_slots = None
        if ctx.tree_branch > 1:
            return self._propose_tree(ctx, k)
        return self._propose_chain(ctx, k)

    def _propose_chain(self, ctx: DraftContext, k: int) -> Draft:
        model, params = self.model, ctx.params
        feed = ctx.sequence[model.cache_len:].unsqueeze(0)  # [1, T] committed tokens not yet seen (all at first)
        seen = ctx.seen
        tokens, dists = [], []
        chain_confidence = 1.0
        for i in range(k):
            logits = model.forward(feed, logits_to_keep=1).logits[0]  # [1, V]
            if seen is not None and tokens:  # the draft token just fed is part of the next prefix
                seen = seen.index_fill(0, tokens[-1], True)
            if params.greedy and params.repetition_penalty == 1.0:
                token = logits.argmax(-1)  # [1]
                confidence = logits.float().softmax(-1).max() if self.min_confidence else None
            else:
                rows = seen.unsqueeze(0) if seen is not None else None
                probs = warp(logits, params, rows)  # [1, V]
                token = probs.argmax(-1) if params.greedy else sample(probs, ctx.generator)
                if not params.greedy:
                    dists.append(probs)
                # Greedy warps to a point mass: its confidence is the unwarped top probability.
                confidence = None if not self.min_confidence else (
                    logits.float().softmax(-1).max() if params.greedy else probs[0, token[0]])
            tokens.append(token)
            if confidence is not None:
                chain_confidence *= float(confidence)
                if chain_confidence < self.min_confidence:
                    break
            if i < k - 1:
                feed = token.view(1, 1)
        self._fed_draft = len(tokens) - 1
        draft_tokens = torch.cat(tokens) if tokens else ctx.sequence.new_empty(0)  # [k]
        q_draft = torch.cat(dists) if dists else None  # [k, V]
        return Draft.chain(draft_tokens, q_draft)

    def _ranking(self, logits: torch.Tensor, params, seen_rows: torch.Tensor | None) -> torch.Tensor:
        """[m, V] the draft's probabilities a tree ranks candidates by: its warped distribution, or
        under greedy decoding its plain softmax (greedy warps to a point mass)."""
        if params.greedy and params.repetition_penalty == 1.0:
            return logits.float().softmax(-1)
        probs = warp(logits, params, seen_rows)
        return logits.float().softmax(-1) if params.greedy else probs

    def _propose_tree(self, ctx: DraftContext, budget: int) -> Draft:
        """A tree of up to `budget` tokens grown level by level (EAGLE-2's dynamic tree).

        Each level, every frontier node offers its `ctx.tree_branch` likeliest next tokens; a
        candidate's score is the product of the draft's probabilities along its path (the
        draft's estimate that the target accepts it). The best `tree_branch` new candidates
        scoring at least `min_confidence` are fed to the draft together (one pass, tree
        attention) and become the next frontier. At the end the `budget` best candidates over
        all levels form the tree: scores never rise along a path, so the choice keeps every
        chosen node's parent.

        Greedy, the children are the draft's top choices (q_draft None: point masses). Sampling,
        a node's first child is drawn from the draft's warped distribution q (its q row goes
        to the verifier, which accepts it with min(1, p/q) like a chain token) and the others
        are the top choices besides it (one-hot q rows: point masses tried after it). The
        drawn child is always tried first among its siblings: the later ones depend on it, which
        multi-draft rejection allows only for proposals tried after it.
        """
        model, params, branch = self.model, ctx.params, ctx.tree_branch
        max_depth = min(budget, ctx.max_depth or budget)
        base = ctx.sequence.shape[0]
        feed = ctx.sequence[model.cache_len:].unsqueeze(0)  # [1, T] committed tokens not yet seen
        logits = model.forward(feed, logits_to_keep=1).logits[0]  # [1, V] after the root
        seen_rows = ctx.seen.unsqueeze(0) if ctx.seen is not None else None  # [1, V]
        # The candidate pool (host lists, a few dozen entries): token, parent (pool index, -1 root), score, depth.
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        fed: list[int] = []  # pool indices in the order they entered the draft's cache
        drawn_from: dict[int, torch.Tensor] = {}  # pool index -> the q row it was drawn from (sampling)
        frontier, frontier_scores = [-1], [1.0]
        for depth in range(1, max_depth + 1):
            probs = self._ranking(logits, params, seen_rows)  # [m, V]
            if params.greedy:
                top_probs, top_tokens = probs.topk(branch, dim=-1)  # [m, B]
            else:  # column 0 drawn from q, then the likeliest others
                drawn = sample(probs, ctx.generator).unsqueeze(-1)  # [m, 1]
                rest_probs, rest_tokens = probs.scatter(-1, drawn, -1.0).topk(branch - 1, dim=-1)  # [m, B - 1]
                if depth == 1 and budget < branch:  # the root's children alone would overrun the budget
                    rest_probs, rest_tokens = rest_probs[:, : budget - 1], rest_tokens[:, : budget - 1]
                top_tokens = torch.cat([drawn, rest_tokens], dim=-1)  # [m, B]
                top_probs = torch.cat([probs.gather(-1, drawn), rest_probs.clamp_min(0.0)], dim=-1)  # [m, B]
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
            frontier = [node for node in new_nodes[:branch] if scores[node] >= self.min_confidence]
            if not params.greedy:  # every candidate joins the tree: expand only what the budget holds
                frontier = frontier[: (budget - len(tokens)) // branch]
            if depth == max_depth or not frontier:
                break
            frontier_scores = [scores[node] for node in frontier]
            # Feed the frontier in one pass: each sees the committed tokens, its fed ancestors and itself.
            fed += frontier
            slot = {node: i for i, node in enumerate(fed)}
            visible = torch.zeros(len(frontier), len(fed), dtype=torch.bool)  # [m, S] over the fed tree tokens
            for row, node in enumerate(frontier):
                visible[row, [slot[i] for i in path_to(node, parents)]] = True
            # Depth-d tokens sit at position base - 1 + d (the root, the last committed token, at base - 1).
            offsets = torch.full((len(frontier),), base - 1 + depth - model.cache_len)  # [m]
            block = torch.tensor([tokens[i] for i in frontier], device=feed.device).unsqueeze(0)  # [1, m]
            logits = model.forward(block, len(frontier), offsets=offsets.to(feed.device),
                                   visible=visible.to(feed.device)).logits[0]  # [m, V]
            if ctx.seen is not None:  # each frontier row has also seen its own path
                seen_rows = ctx.seen.unsqueeze(0).repeat(len(frontier), 1)  # [m, V]
                for row, node in enumerate(frontier):
                    seen_rows[row, [tokens[i] for i in path_to(node, parents)]] = True
        # The tree: greedy, the `budget` best candidates; sampling, every candidate (choosing drawn ones
        # by their drawn value would bias them away from q). Parents first (ties: shallower first),
        # each drawn child moved ahead of its siblings.
        ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))
        chosen: list[int] = []
        for node in ranked[:budget] if params.greedy else ranked:
            if parents[node] < 0 or parents[node] in chosen:
                chosen.append(node)
        for node in drawn_from:
            if node in chosen:
                first_sibling = next(i for i, other in enumerate(chosen) if parents[other] == parents[node])
                chosen.remove(node)
                chosen.insert(first_sibling, node)
        position = {node: i for i, node in enumerate(chosen)}
        fed_slot = {node: slot for slot, node in enumerate(fed)}
        self._tree_slots = [fed_slot.get(node) for node in chosen]
        device = ctx.sequence.device
        draft_tokens = torch.tensor([tokens[i] for i in chosen], dtype=torch.long, device=device)  # [n]
        q_draft = None  # [n, V]: drawn children's q rows, one-hot rows for the rest
        if any(node in drawn_from for node in chosen):
            q_draft = torch.zeros(len(chosen), probs.shape[-1], device=device)
            q_draft[torch.arange(len(chosen), device=device), draft_tokens] = 1.0
            for i, node in enumerate(chosen):
                if node in drawn_from:
                    q_draft[i] = drawn_from[node]
        return Draft.tree(draft_tokens, [position[parents[i]] if parents[i] >= 0 else -1 for i in chosen], q_draft)

    def commit(self, prev_len: int, path: list[int]) -> None:
        # The cache holds the sequence up to prev_len plus the fed draft tokens; keep the accepted ones.
        if self._tree_slots is None:
            self.model.truncate(prev_len + min(len(path), self._fed_draft))
            return
        fed = []  # the accepted path's tokens the draft has seen: a prefix of the path
        for node in path:
            if self._tree_slots[node] is None:
                break
            fed.append(self._tree_slots[node])
        self.model.keep(prev_len, fed)
