"""The `mtp` drafter: the multi-token-prediction layer a model's own checkpoint carries (`models.mtp`), chained to
draft chains and dynamic trees, sharing the target's embeddings and LM head.

It reads the target's final hidden states, which every verification pass already hands to feature drafters (no
extra target pass): the pair (h_t, x_{t+1}) predicts x_{t+2}. The catch-up, the chain, the tree and the cache
follow `layer_head.LayerHeadDrafter` (as `eagle3` does). The layer scores the whole vocabulary, so q is the
drafter's softmax there and the verifier is unchanged.
"""

from __future__ import annotations

from specdraft.drafters.layer_head import LayerHeadDrafter
from specdraft.models.causal_lm import CausalLM
from specdraft.models.mtp import MtpModel


class MtpDrafter(LayerHeadDrafter):
    """Draft with `target`'s own MTP layer `model` (see the module doc)."""

    name = "mtp"
    description = "MTP layer"

    def __init__(self, target: CausalLM, model: MtpModel, min_confidence: float = 0.0) -> None:
        config = model.config
        self.check_made_for(target, config.hidden_size, config.vocab_size, "a model",
                            "Point --trained at the target's own checkpoint folder.")
        super().__init__(target, config.hidden_size, None, min_confidence, head=model.lm_head)
        self.attach(model)
