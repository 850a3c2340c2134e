"""The `medusa` drafter: trained heads on the target's last hidden state propose several tokens at once.

All heads read the same feature, the target's final hidden state under the token before the
last committed one (the one its LM head turned into that token), so one small pass gives a
candidate distribution for every depth: head d for the token d after the last committed one.
The heads cannot see the draft tokens before their own depth, which is Medusa's trade: no
serial draft steps, lower acceptance deeper down.

Chain: head d's top token (greedy) or a token drawn from its warped distribution q_d
(sampling; verified with min(1, p/q) like any drafted token). With a `min_confidence` the chain
ends after the first token at which the heads' running product of the chosen tokens' probabilities
falls below it: that token stays (its presence was decided by the tokens before it), the later
ones go. Tree (`tree_branch` > 1): best-first over the heads' rows (`row_tree`: a node's score is the product of
head probabilities along its path; sampling, each node's first child is drawn from q and always kept once its parent
is, the others are top choices tried after it as point masses).
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.drafters.feature import FeatureDrafter, head_distributions
from specdraft.drafters.row_tree import grow_row_tree
from specdraft.models.causal_lm import CausalLM
from specdraft.models.medusa import MedusaHeads
from specdraft.sampling import sample


class MedusaDrafter(FeatureDrafter):
    """Draft with Medusa heads trained for `target` (see `models.medusa`)."""

    name = "medusa"
    description = "set of Medusa heads"

    def __init__(self, target: CausalLM, heads: MedusaHeads, vocab_ids: torch.Tensor,
                 min_confidence: float = 0.0) -> None:
        super().__init__(target, heads.config.hidden_size, vocab_ids, min_confidence)
        self.heads = heads
        self.run_in_int4(self.heads)
        self._feature: torch.Tensor | None = None  # [H] the newest target feature

    def begin(self, prompt: torch.Tensor) -> None:
        self._feature = None

    def features(self, hidden: torch.Tensor) -> None:  # hidden: [n, H]
        if self.checked(hidden).shape[0]:
            self._feature = hidden[-1]

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        if self._feature is None:  # a one-token prompt: nothing to read yet
            return None
        return super().source(ctx, declined)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        depth = min(k, self.heads.config.num_heads, ctx.max_depth or k)
        feature = self._feature.to(self.dtype).unsqueeze(0)  # [1, H]
        logits = self.vocab_head(self.heads(feature)[0, :depth])  # [depth, V]
        if ctx.tree_branch > 1:
            return grow_row_tree(logits, ctx, k, depth)
        return self._chain(logits, ctx)

    def _chain(self, logits: torch.Tensor, ctx: DraftContext) -> Draft:  # logits: [depth, V]
        if ctx.grammar is not None:  # each head's row masked after the tokens chosen above it: one row at a time
            return self.draw_chain(ctx, logits.shape[0], lambda i, previous: logits[i:i + 1])
        greedy = ctx.params.greedy
        probs = head_distributions(logits, ctx)  # [depth, V]: every row at once
        tokens = probs.argmax(-1) if greedy else sample(probs, ctx.generator)  # [depth]
        if self.min_confidence:  # stop after the token where the heads' estimate that the chain survives falls too low
            survival = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).cumprod(0)  # [depth]
            # Token i stays when the chain *before* it is sure enough (survival[i - 1]), never by its own value: a
            # drawn token kept or cut by its own probability would no longer be distributed as its q row.
            keep = 1 + int((survival[:-1] >= self.min_confidence).sum())
            tokens, probs = tokens[:keep], probs[:keep]
        return Draft.chain(tokens, None if greedy else probs)
