"""The context a model holds (`load_model(max_context=)`, `--context`), fixed at load, and with it the rotary factors
of a LongRoPE model (Phi-3.5, Phi-4-mini).

A LongRoPE model carries two sets of rotary factors: short ones for its pretraining length and long ones past it.
Transformers picks the set per pass, by how far that pass reaches: every position of a pass that crosses the length
rotates with the long factors, the same positions in a pass that does not with the short ones. A verify pass
crossing the length would then rotate its tokens differently from one-token decoding, and speculation would not
be exact. llama.cpp picks the set once, from the context it is asked for (`get_rope_factors`: the long factors when
the context per sequence exceeds the pretraining length, else the short ones), and so does `hold_context`: the
chosen set rotates every position of every pass, on the PyTorch path and on the fused C stack alike (both read the
model's rotary module). The attention factor (the scale of cos and sin) applies under both sets, as in transformers
and llama.cpp; it is pinned before the context changes, so it stays the file's.

Without a context asked for, a LongRoPE model holds its pretraining length (short factors); another model holds what
its positions allow (`max_position_embeddings`). A context past what the model's positions allow is refused, except
where the caller clips it (`clip`: a draft, which holds all its positions allow; `ModelDrafter` keeps its reads
within them, so a draft shorter than the target's context never fails a run).
"""

from __future__ import annotations

from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.fast_layers import FUSED_ATTRIBUTE


def longrope_lengths(config) -> tuple[int, int] | None:
    """(pretraining length, longest context) of a LongRoPE config, None for another rotary. The longest is the
    config's `factor` times the pretraining length where it has one (`gguf_config` keeps the file's context so),
    else its `max_position_embeddings`."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    original = int(rope.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    factor = rope.get("factor")
    return original, round(factor * original) if factor else int(config.max_position_embeddings)


def hold_context(model: nn.Module, context: int | None, name: str, clip: bool = False) -> str:
    """Hold `model` (called `name` in errors) to `context` tokens (None: its default, see the module's text), choosing
    a LongRoPE model's factor set for every pass; with `clip`, a context past what its positions allow holds all they
    allow. Returns what the loading line says of it ("" where there is nothing to say)."""
    config = model.config
    lengths = longrope_lengths(config)
    asked = context
    if lengths is None:
        if context is None:
            return ""
        most = int(getattr(config, "max_position_embeddings", None) or context)
        if context > most and not clip:
            raise SpecdraftError(f"--context {context} is past the {most} positions {name} has; lower --context.")
        context = min(context, most)
        config.max_position_embeddings = context
        return f"context {context}{_clipped(context, asked)}"
    original, longest = lengths
    context = original if context is None else context
    if context > longest and not clip:
        raise SpecdraftError(f"--context {context} is past {name}'s longest context of {longest} (LongRoPE factors "
                             f"for {original} tokens and beyond); lower --context.")
    context = min(context, longest)
    _fix_longrope_factors(model, long=context > original)
    config.max_position_embeddings = context
    if context > original:
        return (f"context {context}{_clipped(context, asked)}: LongRoPE long factors at every position (past its "
                f"{original}-token pretraining length)")
    return (f"context {context}: LongRoPE short factors (its pretraining length is {original}; a --context above it "
            "takes the long factors)")


def _clipped(held: int, asked: int | None) -> str:
    """What the loading line adds where a clipped context holds less than was asked."""
    return f" (all its positions allow of --context {asked})" if asked is not None and held < asked else ""


def _fix_longrope_factors(model: nn.Module, long: bool) -> None:
    """Give both of the config's factor sets the chosen one's values, with the attention factor it had pinned, and
    rebuild the model's rotary module from it: every pass then rotates with that set, whatever it reaches."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, base = model.config, model.model
    rope = dict(config.rope_parameters)
    if rope.get("attention_factor") is None:  # else computed from max_position_embeddings, which changes here
        rope["attention_factor"] = ROPE_INIT_FUNCTIONS["longrope"](config)[1]
    chosen = list(rope["long_factor" if long else "short_factor"])
    rope["long_factor"], rope["short_factor"] = chosen, list(chosen)
    config.rope_parameters = rope
    old = base.rotary_emb
    base.rotary_emb = type(old)(config=config).to(old.inv_freq.device)
    model.__dict__.pop(FUSED_ATTRIBUTE, None)  # a fused decoder built before holds the old rotary module
