"""The `eagle` drafter: a one-layer feature drafter trained on the target's hidden states (EAGLE).

The drafter's cache holds one entry per pair (f_t, x_{t+1}): the target's feature at t and
the token after it. Features arrive from the target's own passes (prefill and every
verification: no extra target pass), so before drafting the drafter catches up on the pairs
it has not seen, in one pass whose last row predicts the feature after the last committed
token; each draft token is then read off a predicted feature and fed back with it.

After the verdict the drafter's cache is cut back to the pairs built from real features;
the accepted tokens come back as real pairs at the next catch-up (the target's features of
them are better than the predicted ones).
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.drafters.dynamic_tree import grow_dynamic_tree
from specdraft.drafters.feature import CatchUpDrafter
from specdraft.models.causal_lm import CausalLM
from specdraft.models.eagle import EagleDrafterModel


class EagleDrafter(CatchUpDrafter):
    """Draft with an EAGLE feature drafter trained for `target` (see `models.eagle`)."""

    name = "eagle"
    description = "EAGLE drafter"

    def __init__(self, target: CausalLM, model: EagleDrafterModel, vocab_ids: torch.Tensor,
                 min_confidence: float = 0.0) -> None:
        super().__init__(target, model.config.hidden_size, vocab_ids, min_confidence)
        self.attach(model)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (features[i], tokens[i]) at positions start.. and return the predicted next features. # [n, H]"""
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        return self.model(features.to(self.dtype), self.embed(tokens).to(self.dtype), positions)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        model, sequence = self.model, ctx.sequence
        fresh = self.take_pending()  # [n, H]
        # Catch up: pairs (f_t, x_{t+1}) for every feature that arrived since the last draft.
        model.truncate(self._real)
        start = self._real
        predicted = self._step(fresh, sequence[start + 1:start + 1 + fresh.shape[0]], start)[-1:]  # [1, H]
        self._real = start + fresh.shape[0]
        if ctx.tree_branch > 1:
            return self._tree(ctx, k, predicted)

        def row_logits(i: int, previous: torch.Tensor | None) -> torch.Tensor:  # [1, V]
            nonlocal predicted
            if i:  # the previous token fed back with the feature predicted before it
                predicted = self._step(predicted, previous, self._real + i - 1)  # [1, H]
            return self.vocab_head(predicted)

        return self.draw_chain(ctx, min(k, ctx.max_depth or k), row_logits)

    def _tree(self, ctx: DraftContext, budget: int, root_feature: torch.Tensor) -> Draft:
        """A dynamic tree (see `dynamic_tree`): each level's nodes are fed with their parents' predicted
        features in one pass. # root_feature: [1, H]"""
        after: dict[int, torch.Tensor] = {}  # pool index -> the feature predicted after it
        start = self._real  # position of the pairs of depth-1 tokens

        def expand(frontier: list[int], block: torch.Tensor, depth: int, visible: torch.Tensor,
                   parents: list[int]) -> torch.Tensor:
            inputs = torch.stack([root_feature[0] if parents[node] < 0 else after[parents[node]] for node in frontier])
            positions = torch.full((len(frontier),), start + depth - 1, device=block.device)  # [m]
            predicted = self.model(inputs.to(self.dtype), self.embed(block[0]).to(self.dtype), positions, visible=visible)
            after.update(zip(frontier, predicted))
            return self.vocab_head(predicted)  # [m, V]

        return grow_dynamic_tree(self.vocab_head(root_feature), expand, ctx, budget, self.min_confidence).draft

    def commit(self, prev_len: int, path: list[int]) -> None:
        self.model.truncate(self._real)  # drafted entries go; the accepted tokens return as real pairs
