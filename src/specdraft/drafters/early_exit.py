"""The `early-exit` drafter: self-speculation with the target's own first L layers.

The draft model is `early_exit_view(target, L)`: the target's embedding, its first L
decoder layers, its final norm and its LM head (LayerSkip, Draft & Verify). It drafts token
by token exactly like the `model` drafter (same warping, same `min_confidence` stop).

Shared with the target: every weight. The view holds the target's own modules, so the
drafter costs no weight memory and needs no second model or tokenizer.

Not shared: the KV cache. The drafter keeps its own cache of L layers (L/N of the target's
KV memory) and runs the prompt through those L layers once per request. The target's first
L layers hold the same keys and values for the committed tokens, but that cache belongs to
the target's `CausalLM`, which cuts it back on its own schedule, and the engine may hand
the drafter another wrapper of the same model; sharing it would need the engine to pass the
target's cache to the drafter and cut the draft's entries back before each verification.
LayerSkip's larger saving, verification reusing the draft's first L layers, would need a
forked forward pass and is not attempted.
"""

from __future__ import annotations

from specdraft.drafters.model import DEFAULT_MIN_CONFIDENCE, ModelDrafter
from specdraft.models.causal_lm import CausalLM
from specdraft.models.early_exit import decoder_layers, early_exit_view

# Without --exit-layer: this share of the layers. Measured on the bundled Qwen2.5-Coder-1.5B (28 layers,
# `specdraft diagnose --draft early-exit:L`): top-1 agreement 0.03 at L=12, 0.18 at 20, 0.43 at 24, 0.57 at 26.
DEFAULT_EXIT_FRACTION = 0.75


class EarlyExitDrafter(ModelDrafter):
    """Draft with the target's first `exit_layer` layers, final norm and LM head (shared weights)."""

    name = "early-exit"

    def __init__(self, target: CausalLM, exit_layer: int | None = None,
                 min_confidence: float = DEFAULT_MIN_CONFIDENCE) -> None:
        if exit_layer is None:
            layers = len(decoder_layers(target.model))  # a proper prefix: at most all layers but the last
            exit_layer = max(1, min(layers - 1, round(DEFAULT_EXIT_FRACTION * layers)))
        super().__init__(early_exit_view(target, exit_layer), min_confidence)
        self.exit_layer = exit_layer
