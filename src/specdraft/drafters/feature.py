"""What the trained drafters (`medusa`, `eagle`) share: they read the target's final hidden states
and score tokens through the target's own LM head restricted to their vocabulary."""

from __future__ import annotations

import copy

import torch

from specdraft.drafters.base import DraftContext, Drafter
from specdraft.drafters.dynamic_tree import ranking
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import target_subset_head
from specdraft.models.quantize import int4_kernel_available, quantize_int4


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
        self.dtype = self.vocab_head.inner.weight.dtype  # what features are cast to (kept when the head goes int4)
        self.min_confidence = min_confidence

    def sibling(self) -> "FeatureDrafter":
        """A drafter for another sequence (of a batch) over the same trained weights and vocabulary head: the
        weights are loaded and packed once, however many sequences draft with them. Its state is its own once
        `begin` sets it, which every request does first; a drafter that keeps state in its weights' module (a
        cache) makes that its own here."""
        return copy.copy(self)

    def run_in_int4(self, module: torch.nn.Module) -> None:
        """On the CPU, swap the linears of `module` (the trained weights) and of the vocabulary head for int4
        kernels, as `--draft-quant auto` does for a draft model: a bandwidth-bound draft token then reads a
        quarter of the bytes (the shipped EAGLE drafter in float32: 4.9 ms for its head, 2.5 ms for its layer).
        Drafts only propose differently; the output stays exact, q being what they were drawn from."""
        if self.vocab_head.ids.device.type == "cpu" and int4_kernel_available():
            quantize_int4(module)
            quantize_int4(self.vocab_head)
