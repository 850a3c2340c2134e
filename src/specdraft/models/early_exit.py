"""Early exit: the target's first L decoder layers, its final norm and its LM head, as a model.

`early_exit_view(lm, L)` builds a *view* of a Hugging Face decoder model, not a copy: a
shallow copy of the model object (and of its base model) whose layer list holds the first L
layer modules of the target, the same module objects, and whose config says L layers. The
embedding, the layers, the final norm and the LM head are the target's own modules, so the
view adds no weight memory and runs transformers' own modeling code (no forked forward).

Why a fresh cache of L layers is right: each attention module indexes the cache by its
`layer_idx`, and the first L layers keep theirs, 0..L-1. Per-layer config lists that size
things by the layer count (`layer_types`, ...) are cut to their first L entries, so the
view's cache holds L layers and the model's masks (full or sliding) are built for exactly those layers.

`exit_layer_agreement` measures, for choosing L, how often the exit at layer L predicts
the full model's next token.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM

# Config lists with one entry per decoder layer (cut to the first L entries in a view).
# Lists of layer *indices* (e.g. `mlp_only_layers`) stay as they are: they select the same
# layers among the first L.
PER_LAYER_CONFIG_LISTS = (
    "layer_types", "mlp_layer_types", "layers_block_type", "indexer_types", "kv_sharing_modes",
    "no_rope_layers", "num_key_value_heads_per_layer", "num_attention_heads_per_layer",
)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM (`model.model.layers`), or a SpecdraftError."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None) if isinstance(base, nn.Module) else None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise SpecdraftError(
            f"Early exit needs a decoder model whose layers are `model.model.layers` (Qwen2, Llama, Mistral, ...); "
            f"{type(model).__name__} has none. Use another drafter for this model."
        )
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last decoder layer (`model.model.norm`), or a SpecdraftError."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    if not isinstance(norm, nn.Module):
        raise SpecdraftError(
            f"Early exit needs the final norm at `model.model.norm`; {type(model).__name__} has none."
        )
    return norm


EARLY_EXIT_PREFIX = "early-exit:"


def early_exit_layer(spec: str) -> int | None:
    """L of a draft written `early-exit:L` (the target's first L layers), None for any other draft."""
    if not spec.startswith(EARLY_EXIT_PREFIX):
        return None
    try:
        return int(spec.removeprefix(EARLY_EXIT_PREFIX))
    except ValueError:
        raise SpecdraftError(f"Write an early-exit draft as early-exit:L with a whole number L, got {spec!r}.") from None


def check_exit_layer(lm: CausalLM, exit_layer: int, allow_all: bool = False) -> int:
    """`exit_layer` as an int in 1..num_layers-1 (1..num_layers with `allow_all`), else a SpecdraftError."""
    num_layers = len(decoder_layers(lm.model))
    highest = num_layers if allow_all else num_layers - 1
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer <= highest:
        raise SpecdraftError(
            f"The exit layer must be an integer from 1 to {highest} ({lm.name} has {num_layers} decoder layers), "
            f"got {exit_layer!r}."
        )
    return exit_layer


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object holding the same submodules, parameters and buffers as `module`.

    Its containers (`_modules`, `_parameters`, hook dicts, ...) are its own copies, so
    replacing a submodule or adding a hook on the copy leaves `module` as it was.
    """
    twin = copy.copy(module)
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, set, list)):
            twin.__dict__[key] = copy.copy(value)
    return twin


def _install_output_hooks(base_model: nn.Module) -> None:
    """Install transformers' output-capture hooks on the target now (as its first
    `output_hidden_states=True` call would), so the target and the view, whose layers are
    the same modules, never install them twice (twice would repeat hidden states)."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without lazily installed hooks: nothing to share
        return
    maybe_install_capturing_hooks(base_model)


def _exit_config(config, exit_layer: int):
    """A copy of `config` that says `exit_layer` layers; the target's config is not touched."""
    num_layers = config.num_hidden_layers
    view_config = copy.deepcopy(config)
    view_config.num_hidden_layers = exit_layer
    for name in PER_LAYER_CONFIG_LISTS:
        value = getattr(view_config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == num_layers:
            setattr(view_config, name, type(value)(value[:exit_layer]))
    return view_config


def early_exit_view(lm: CausalLM, exit_layer: int) -> CausalLM:
    """A `CausalLM` running `lm`'s first `exit_layer` layers, its final norm and its LM head.

    Shares every weight with `lm` (same module objects); has its own KV cache of
    `exit_layer` layers. `lm`'s model, config, layer list and weights are left as they
    were; the one thing done to it is installing transformers' output-capture hooks now
    rather than at its first `output_hidden_states` call (see `_install_output_hooks`).
    """
    exit_layer = check_exit_layer(lm, exit_layer)
    model = lm.model
    layers = decoder_layers(model)
    final_norm(model)
    for index, layer in enumerate(layers[:exit_layer]):
        for sub in layer.modules():  # the cache is indexed by layer_idx: it must be the layer's position
            layer_idx = getattr(sub, "layer_idx", None)
            if isinstance(layer_idx, int) and layer_idx != index:
                raise SpecdraftError(
                    f"Decoder layer {index} of {lm.name} calls itself layer {layer_idx}; early exit cannot "
                    "give it a cache of its own."
                )

    _install_output_hooks(model.model)
    view_config = _exit_config(model.config, exit_layer)
    view_base = _shallow_copy(model.model)
    view_base.layers = nn.ModuleList(list(layers[:exit_layer]))  # the same layer modules, first L of them
    view_base.config = view_config
    if hasattr(view_base, "has_sliding_layers") and getattr(view_config, "layer_types", None) is not None:
        view_base.has_sliding_layers = "sliding_attention" in view_config.layer_types
    view = _shallow_copy(model)
    view.model = view_base
    view.config = view_config
    return CausalLM(view, lm.tokenizer, name=f"{lm.name}[:{exit_layer}]")


@torch.inference_mode()
def exit_layer_agreement(lm: CausalLM, token_ids: list[list[int]], layers: list[int]) -> dict[int, float]:
    """For each exit layer L, the fraction of positions where the exit's argmax equals the full model's.

    One full forward per sequence (no cache: `lm`'s cache is untouched) returns every
    layer's hidden state; the exit at L is `lm_head(norm(hidden_states[L]))`. L may be
    num_layers (agreement 1.0). Logit scalings and soft-caps after the head are monotone,
    so they do not change an argmax and are not applied.
    """
    exits = sorted({check_exit_layer(lm, layer, allow_all=True) for layer in layers})
    model = lm.model
    num_layers = len(decoder_layers(model))
    norm, head = final_norm(model), model.get_output_embeddings()
    matches = dict.fromkeys(exits, 0)
    positions = 0
    for ids in token_ids:
        if not ids:
            continue
        if len(ids) > lm.max_context:
            raise SpecdraftError(f"A sequence of {len(ids)} tokens is past {lm.name}'s context of {lm.max_context}.")
        tokens = torch.tensor([ids], dtype=torch.long, device=lm.device)  # [1, T]
        out = model(input_ids=tokens, use_cache=False, output_hidden_states=True, logits_to_keep=0)
        hidden_states = out.hidden_states  # num_layers + 1 of [1, T, H]: embeddings, then each layer's output
        if len(hidden_states) != num_layers + 1:
            raise SpecdraftError(
                f"{lm.name} returned {len(hidden_states)} hidden states for {num_layers} layers; "
                "cannot tell which is which layer's output."
            )
        full_argmax = out.logits[0].argmax(-1)  # [T]
        for layer in exits:
            if layer == num_layers:  # the last entry already has the final norm applied
                exit_argmax = full_argmax
            else:
                exit_argmax = head(norm(hidden_states[layer][0])).argmax(-1)  # [T, V] -> [T]
            matches[layer] += int((exit_argmax == full_argmax).sum())
        positions += tokens.shape[1]
    if positions == 0:
        raise SpecdraftError("Exit-layer agreement needs at least one non-empty token sequence.")
    return {layer: matches[layer] / positions for layer in exits}
