"""The `dflash` drafter: a published DFlash block draft (`models.dflash`) proposes a whole chain in one pass.

It reads the target's states after the layers the checkpoint names (`CausalLM.read_features_at`, as `eagle3` does:
the verification passes hand them over, no extra target pass). Each step it adds the context rows it has not seen
to its caches and runs the block [last committed token, mask, mask, ...] once; row i is the distribution of the
i-th draft token. Rows do not depend on the tokens drawn from them, so each token is drawn from its own row and
that row is its q.

The confidence cut (`min_confidence`) keeps drawing while the product of the probabilities of the tokens drawn so
far stays at or above the threshold: token i is drawn only if the tokens before it keep the product up, so whether a
token is in the draft never depends on its own value. A constraint masks row i after the tokens drawn before it.

Trees (`tree_branch` > 1): the rows are independent, as Medusa's heads are, so the tree is `row_tree`'s best-first
tree over them, as `medusa` grows it: a node's score is the product of the row probabilities along its path; up to
`k` nodes, no deeper than the block's rows or `max_depth`. Sampling, each node's first child is drawn from its row
(its q) and always kept once its parent is; the others are the row's top choices, tried after it as point masses.
Under a constraint each node's row is masked after its own path. The confidence cut is a chain's; a tree is bounded
by its budget.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.drafters.feature import CatchUpDrafter
from specdraft.drafters.row_tree import grow_row_tree
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.dflash import DFlashModel
from specdraft.models.mtp_loading import full_target_head


class DFlashDrafter(CatchUpDrafter):
    """Draft with a DFlash block draft for `target` (see the module doc)."""

    name = "dflash"
    description = "DFlash draft"

    def __init__(self, target: CausalLM, model: DFlashModel, min_confidence: float = 0.0) -> None:
        config = model.config
        self.check_made_for(target, config.hidden_size, config.vocab_size, "a target",
                            "Use the draft published for this target.")
        if any(not 0 <= i < target.config.num_hidden_layers for i in config.target_layers):
            raise SpecdraftError(f"This DFlash draft reads the outputs of target layers "
                                 f"{[i - 1 for i in config.target_layers]} (dflash_config.target_layer_ids); "
                                 f"{target.name} has {target.config.num_hidden_layers} layers and the last one's "
                                 "output is not read.")
        super().__init__(target, config.hidden_size, None, min_confidence, head=full_target_head(target))
        self.features_width = len(config.target_layers) * config.hidden_size  # the layers' states side by side
        self.feature_layers = tuple(config.target_layers)
        self.attach(model)  # `_real`: context rows in the caches
        self.claim_features()

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        model, config = self.model, self.model.config
        fresh = self.take_pending()  # [n, features_width]
        start, anchor = self._real, self._real + fresh.shape[0]
        block = torch.full((config.block_size,), config.mask_token_id, device=ctx.sequence.device)  # [B]
        block[0] = ctx.sequence[anchor]
        out = model(fresh.to(self.dtype), self.embed(block).to(self.dtype), start, anchor)  # [B, H]
        self._real = anchor
        depth = min(k, ctx.max_depth or k, config.block_size - 1)
        logits = self.vocab_head(out[1:1 + depth])  # [depth, V]: row i - 1 for the token at anchor + i
        if ctx.tree_branch > 1:
            return grow_row_tree(logits, ctx, k, depth)
        return self.draw_chain(ctx, depth, lambda i, previous: logits[i:i + 1])  # rows never read the tokens drawn

    def commit(self, prev_len: int, path: list[int]) -> None:
        """Nothing to cut: the caches hold only the target's context, never the block."""
