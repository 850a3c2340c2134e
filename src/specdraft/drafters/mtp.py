"""The `mtp` drafter: the multi-token-prediction layer a model's own checkpoint carries (`models.mtp`), chained to
draft chains and dynamic trees, sharing the target's embeddings and LM head.

It reads the target's final hidden states, which every verification pass already hands to feature drafters (no
extra target pass): the pair (h_t, x_{t+1}) predicts x_{t+2}. The catch-up, the chain, the tree and the cache
follow `layer_head.LayerHeadDrafter` (as `eagle3` does). The layer scores the whole vocabulary, so q is the
drafter's softmax there and the verifier is unchanged.
"""

from __future__ import annotations

import torch

from specdraft.drafters.layer_head import LayerHeadDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.mtp import MtpModel


class MtpDrafter(LayerHeadDrafter):
    """Draft with `target`'s own MTP layer `model` (see the module doc)."""

    name = "mtp"
    description = "MTP layer"

    def __init__(self, target: CausalLM, model: MtpModel, min_confidence: float = 0.0) -> None:
        config = model.config
        if config.vocab_size != target.vocab_size or config.hidden_size != target.config.hidden_size:
            raise SpecdraftError(f"This MTP layer was made for a model {config.hidden_size} wide with "
                                 f"{config.vocab_size} tokens (its config.json); {target.name} is "
                                 f"{target.config.hidden_size} wide with {target.vocab_size}. Point --trained at the "
                                 "target's own checkpoint folder.")
        super().__init__(target, config.hidden_size, None, min_confidence, head=model.lm_head)
        self.target, self.model = target, model
        self.run_in_int4(self.model)
        self.embed = target.model.get_input_embeddings()
        self._pending: list[torch.Tensor] = []  # [n, H] final states not yet in the layer's cache
        self._real = 0  # cache rows built from the target's own states
