"""What the trained drafters (`medusa`, `eagle`) share: they read the target's final hidden states
and score tokens through the target's own LM head restricted to their vocabulary."""

from __future__ import annotations

import torch

from specdraft.drafters.base import DraftContext, Drafter
from specdraft.drafters.dynamic_tree import ranking
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import target_subset_head


def head_distributions(logits: torch.Tensor, ctx: DraftContext) -> torch.Tensor:
    """[m, V] what each row's candidates are drawn from (sampling) or ranked by (greedy: the plain softmax)."""
    seen_rows = ctx.seen.unsqueeze(0).expand(logits.shape[0], -1) if ctx.seen is not None else None
    return ranking(logits, ctx.params, seen_rows)


class FeatureDrafter(Drafter):
    """A drafter trained on `target`'s final hidden states (of size `hidden_size`), drafting tokens
    among `vocab_ids` through the target's LM head; a chain stops once its estimated survival
    falls below `min_confidence`."""

    needs_features = True
    description = "drafter"  # how errors name it

    def __init__(self, target: CausalLM, hidden_size: int, vocab_ids: torch.Tensor, min_confidence: float) -> None:
        if hidden_size != target.config.hidden_size:
            raise SpecdraftError(f"This {self.description} reads hidden states of size {hidden_size}; "
                                 f"{target.name}'s are {target.config.hidden_size}.")
        self.vocab_head = target_subset_head(target, vocab_ids)
        self.min_confidence = min_confidence
