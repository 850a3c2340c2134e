"""Writing an `eagle3.Eagle3Model` as a SpecForge checkpoint folder, the format `eagle3_loading.read_folder` reads
(and SGLang, vLLM and llama.cpp's converter take):

- `config.json`: a flat Llama config of the one decoder layer (`architectures: ["LlamaForCausalLMEagle3"]`,
  `num_hidden_layers: 1`, `hidden_size`, heads, `intermediate_size`, `rms_norm_eps`, `rope_theta` and
  `rope_scaling`, `vocab_size`: the target's), with `draft_vocab_size`, `target_hidden_size` where it differs from
  the head's width, and the target layers `fc` reads as SGLang names them (`eagle_config`:
  `eagle_aux_hidden_state_layer_ids`, the output of layer i: transformers' `hidden_states[i + 1]`);
- `model.safetensors`: `fc.weight`, `midlayer.*` (the layer, by `eagle3_loading.LAYER_NAMES`), `norm.weight`,
  `lm_head.weight` (one row per draft token), `d2t` (draft id j -> target id j + d2t[j], int64), `t2d` (bool over
  the target's vocabulary: which tokens the draft has), and `embed_tokens.weight` where given.

Only what a SpecForge config can say is written: a head with q/k norms, biases, fc norms, a norm before fc or the
residual, or one that feeds back its normed state is refused (those are other formats' options).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdraft.errors import SpecdraftError
from specdraft.models.eagle3 import Eagle3Model
from specdraft.models.eagle3_loading import LAYER_NAMES

LAYER_PREFIX = "midlayer."  # SpecForge's name for the decoder layer
CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def specforge_config(model: Eagle3Model, target_layers: int, max_positions: int) -> dict:
    """The config.json of `model`, a head for a target of `target_layers` decoder layers and `max_positions`."""
    config = model.config
    unsaid = [name for name, used in (("q/k norms", config.qk_norm), ("attention biases", config.attention_bias),
                                      ("fc norms", config.fc_norm), ("a norm before fc", config.norm_before_fc),
                                      ("a norm before the residual", config.norm_before_residual),
                                      ("normed states fed back", config.feed_normed),
                                      ("lm_head on the un-normed state", not config.logits_normed),
                                      ("llama.cpp rope factors", config.rope_factors is not None)) if used]
    if unsaid:
        raise SpecdraftError(f"This EAGLE-3 head has {', '.join(unsaid)}, which a SpecForge config.json cannot say.")
    rope = dict(config.rope_parameters)
    theta = float(rope.pop("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    layers = config.resolved_aux_layers(target_layers)
    written = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": config.rms_eps,
        "rope_theta": theta, "rope_scaling": scaling, "max_position_embeddings": max_positions,
        "attention_bias": False, "tie_word_embeddings": False, "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size, "torch_dtype": "bfloat16",
        # SGLang captures layer i's output, transformers' hidden_states[i + 1]
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True},
    }
    if config.target_hidden_size != config.hidden_size:
        written["target_hidden_size"] = config.target_hidden_size
    return written


def specforge_tensors(model: Eagle3Model, embeddings: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`model`'s weights by their SpecForge names, floats in `dtype` (see the module doc); `embeddings`
    `[vocab, H]`: the token embeddings to ship with the head (its own, where it has them, win)."""
    published = {value: LAYER_PREFIX + name for name, value in LAYER_NAMES.items()}
    state = model.state_dict()
    ids = state.pop("lm_head.ids").cpu()  # [draft vocab] sorted target ids: draft id j is ids[j]
    tensors = {"lm_head.weight": state.pop("lm_head.inner.weight")}
    if embeddings is not None and "embed_tokens.weight" not in state:
        tensors["embed_tokens.weight"] = embeddings
    for name, value in state.items():
        tensors[published.get(name, name)] = value
    tensors = {name: value.detach().to("cpu", dtype).contiguous() for name, value in tensors.items()}
    tensors["d2t"] = ids - torch.arange(ids.shape[0])
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def save_specforge_folder(model: Eagle3Model, folder: str | Path, target_layers: int, max_positions: int,
                          embeddings: torch.Tensor | None = None, extra: dict[str, object] | None = None) -> Path:
    """Write `model` to `folder` as a SpecForge checkpoint (config.json, model.safetensors) and each of `extra`
    (file name -> JSON), every file whole (written aside, then renamed). Other files in the folder are kept."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / (WEIGHTS + ".tmp")
    save_file(specforge_tensors(model, embeddings), str(weights))
    os.replace(weights, folder / WEIGHTS)
    for name, content in {CONFIG: specforge_config(model, target_layers, max_positions), **(extra or {})}.items():
        temporary = folder / (name + ".tmp")
        temporary.write_text(json.dumps(content, indent=2))
        os.replace(temporary, folder / name)
    return folder
