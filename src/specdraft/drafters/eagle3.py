"""The `eagle3` drafter: a published EAGLE-3 head (`models.eagle3`) drafting chains and dynamic trees.

The head reads the target's states entering three of its layers (low, middle, high), which the drafter asks the
target's passes for (`CausalLM.read_features_at`): prefill and every verification then hand over those, for the
kept rows, as they hand other feature drafters the final states (no extra target pass). Before drafting the
drafter catches up on the pairs (g_t = fc(features_t), x_{t+1}) it has not seen, in one pass whose last row
predicts the token after the last committed one; each draft token is then read off the layer's output h, which is
fed back with the token for the next one.

The head scores its draft vocabulary only; its logits come widened to the target's vocabulary with -inf off it
(`draft_head.SubsetHead`, draft id j -> target id j + d2t[j]), so q = 0 outside the draft vocabulary and the
verifier's min(1, p/q) and residual max(p - q, 0) stay exact: a target token the head cannot propose is still
reached through the residual.

After the verdict the layer's cache is cut back to the pairs built from the target's own features; the accepted
tokens return as real pairs at the next catch-up (`layer_head.LayerHeadDrafter`, shared with `mtp`).
"""

from __future__ import annotations

from specdraft.drafters.layer_head import LayerHeadDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.eagle3 import Eagle3Model


class Eagle3Drafter(LayerHeadDrafter):
    """Draft with a published EAGLE-3 head for `target` (see the module doc)."""

    name = "eagle3"
    description = "EAGLE-3 head"

    def __init__(self, target: CausalLM, model: Eagle3Model, min_confidence: float = 0.0) -> None:
        config = model.config
        if config.vocab_size != target.vocab_size:
            raise SpecdraftError(f"This EAGLE-3 head was made for a vocabulary of {config.vocab_size} tokens "
                                 f"(vocab_size in its config); {target.name}'s logits have {target.vocab_size}. "
                                 "Use the head published for this target.")
        if model.embed_tokens is None and config.hidden_size != target.config.hidden_size:
            raise SpecdraftError(f"This EAGLE-3 head is {config.hidden_size} wide and has no embed_tokens of its "
                                 f"own; {target.name}'s embeddings are {target.config.hidden_size} wide.")
        super().__init__(target, config.target_hidden_size, None, min_confidence, head=model.lm_head)
        self.feature_layers = config.resolved_aux_layers(target.config.num_hidden_layers)
        self.features_width = len(self.feature_layers) * config.target_hidden_size  # the layers' states side by side
        self.attach(model)
        self.claim_features()
