"""What the one-layer heads that read the target's states and chain their own outputs share (`eagle3`, `mtp`):
catching up on the target's states, drafting chains and dynamic trees, and their KV cache.

The head (`model`: `eagle3.Eagle3Model`, `mtp.MtpModel`) reads pairs (s_t, x_{t+1}): s_t a state of the target's at
position t (`model.project` of what the target's passes hand over: fused features, or the final states as they are)
and the token that followed. Before drafting the drafter catches up on the pairs it has not seen, in one pass whose
last row predicts the token after the last committed one; each draft token is then read off the layer's output,
which is fed back (`model.fed_back`) with the token for the next one.

The head's logits are over the target's vocabulary (-inf where it cannot propose: q = 0 there), so the verifier's
min(1, p/q) and residual max(p - q, 0) stay exact. A chain's confidence cut (`min_confidence`) multiplies the
probabilities of the tokens drafted so far and stops after the token that takes it below the threshold: whether a
drawn token stays never depends on its own value (the token is kept; only the next ones are not drawn).

After the verdict the layer's cache is cut back to the pairs built from the target's own states; the accepted
tokens return as real pairs at the next catch-up.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.drafters.dynamic_tree import grow_dynamic_tree
from specdraft.drafters.feature import CatchUpDrafter


class LayerHeadDrafter(CatchUpDrafter):
    """Drafting with a one-layer head over the target's states (see the module doc). A subclass calls `attach` with
    the head, having set `self.features_width` where it reads several layers' states side by side."""

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: [n] -> [n, H]
        return self.model.embed(tokens, self.embed).to(self.dtype)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        model, sequence = self.model, ctx.sequence
        fresh = self.take_pending()  # [n, features_width]
        # Catch up: pairs (project(f_t), x_{t+1}) for every feature that arrived since the last draft.
        model.truncate(self._real)
        start = self._real
        tokens = sequence[start + 1:start + 1 + fresh.shape[0]]  # [n]
        positions = torch.arange(start, start + fresh.shape[0], device=tokens.device)  # [n]
        out = model(model.project(fresh.to(self.dtype)), self._embed(tokens), positions)[-1:]  # [1, H]
        self._real = start + fresh.shape[0]
        if ctx.tree_branch > 1:
            return self._tree(ctx, k, out)

        def row_logits(i: int, previous: torch.Tensor | None) -> torch.Tensor:  # [1, V]: -inf off the vocabulary
            nonlocal out
            if i:  # the previous token fed back
                position = torch.full((1,), self._real + i - 1, device=previous.device)
                out = model(model.fed_back(out), self._embed(previous), position)  # [1, H]
            return model.draft_logits(out)

        return self.draw_chain(ctx, min(k, ctx.max_depth or k), row_logits)

    def _tree(self, ctx: DraftContext, budget: int, root_out: torch.Tensor) -> Draft:
        """A dynamic tree (see `dynamic_tree`): each level's nodes are fed, with what their parents' outputs feed
        back, in one pass. # root_out: [1, H]"""
        model = self.model
        after: dict[int, torch.Tensor] = {}  # pool index -> what the next position reads after it  [H]
        root = model.fed_back(root_out)[0]  # [H]
        start = self._real  # position of the pairs of depth-1 tokens

        def expand(frontier: list[int], block: torch.Tensor, depth: int, visible: torch.Tensor,
                   parents: list[int]) -> torch.Tensor:
            inputs = torch.stack([root if parents[node] < 0 else after[parents[node]] for node in frontier])  # [m, H]
            positions = torch.full((len(frontier),), start + depth - 1, device=block.device)  # [m]
            out = model(inputs, self._embed(block[0]), positions, visible=visible)  # [m, H]
            after.update(zip(frontier, model.fed_back(out)))
            return model.draft_logits(out)  # [m, V]

        return grow_dynamic_tree(model.draft_logits(root_out), expand, ctx, budget, self.min_confidence).draft

    def commit(self, prev_len: int, path: list[int]) -> None:
        self.model.truncate(self._real)  # drafted rows go; the accepted tokens return as real pairs
