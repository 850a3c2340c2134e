"""Reading a published EAGLE-3 head into an `eagle3.Eagle3Model`, from any of the three files users have:

- a SpecForge / EAGLE / AngelSlim folder (`LlamaForCausalLMEagle3`): a flat Llama config.json with
  `draft_vocab_size` (and `target_hidden_size`, `fc_norm`, `norm_output`, `eagle_config` where set) and tensors
  `fc.weight`, `midlayer.*` (the decoder layer), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, often
  `embed_tokens.weight`;
- a vLLM speculators folder (`Eagle3Speculator`): the layer's config nested as `transformer_layer_config` (a Llama
  or Qwen3 config, saved as its difference from that class's defaults), the EAGLE-3 keys beside it
  (`draft_vocab_size`, `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`), tensors `layers.0.*` and the same others;
- the GGUF that llama.cpp's `convert_hf_to_gguf.py --target-model-dir` makes of either (architecture `eagle3`):
  keys `eagle3.target_layers`, `eagle3.target_hidden_size`, `eagle3.norm_before_residual`,
  `eagle3.norm_before_fc` beside Llama's, tensors `fc.weight`, `enc.output_norm.weight` (the `input_norm`),
  `blk.0.attn_norm` (input_layernorm), `blk.0.attn_norm_2` (hidden_norm), `blk.0.attn_{q,k,v,output}` (q and k
  rows in llama.cpp's rotary order), `blk.0.ffn_{norm,gate,up,down}`, `output_norm`, `output`, `token_embd`
  (where the head has its own), `rope_freqs` (Llama 3 scaling), and `d2t` as absolute target ids (I64; `t2d` is
  dropped).

Which target layers feed `fc`: `eagle_aux_hidden_state_layer_ids` at the top of the config (vLLM, speculators,
llama.cpp: the input of layer i, transformers' `hidden_states[i]`) or in SpecForge's `eagle_config` (SGLang
captures the output of layer i there: `hidden_states[i + 1]`); with neither, (2, L // 2, L - 3) for the target.

Every tensor is checked by name and shape against the config before anything runs: a missing, unexpected or
misshapen one raises SpecdraftError naming it and the key that sets its shape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.checkpoint_tensors import DECODER_LAYER_NAMES, check_shapes, read_weights
from specdraft.models.eagle3 import Eagle3Config, Eagle3Model
from specdraft.models.gguf_header import read_header
from specdraft.models.gguf_native import _rotary_row_order, _TensorFile

IGNORED = {"t2d", "verifier_lm_head.weight", "verifier_norm.weight"}  # never read at inference (the sources agree)
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")  # SpecForge, speculators, a transformers-style save
LAYER_NAMES = {  # the published decoder layer's names (after the prefix) -> ours
    **DECODER_LAYER_NAMES, "hidden_norm.weight": "hidden_norm.weight",
}
TOP_NAMES = {"fc.weight", "input_norm.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t"}
GGUF_NAMES = {  # llama.cpp's names -> ours (blk.0 is the one layer)
    "fc.weight": "fc.weight", "enc.output_norm.weight": "input_norm.weight", "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight", "token_embd.weight": "embed_tokens.weight",
    "blk.0.attn_norm.weight": "input_layernorm.weight", "blk.0.attn_norm_2.weight": "hidden_norm.weight",
    "blk.0.attn_q.weight": "q_proj.weight", "blk.0.attn_k.weight": "k_proj.weight",
    "blk.0.attn_v.weight": "v_proj.weight", "blk.0.attn_output.weight": "o_proj.weight",
    "blk.0.attn_q.bias": "q_proj.bias", "blk.0.attn_k.bias": "k_proj.bias", "blk.0.attn_v.bias": "v_proj.bias",
    "blk.0.attn_output.bias": "o_proj.bias", "blk.0.ffn_norm.weight": "post_attention_layernorm.weight",
    "blk.0.ffn_gate.weight": "gate_proj.weight", "blk.0.ffn_up.weight": "up_proj.weight",
    "blk.0.ffn_down.weight": "down_proj.weight",
}
SHAPE_KEYS = {  # which config keys set each tensor's shape, for the error that names a misshapen one
    "fc.weight": "hidden_size, target_hidden_size, eagle_aux_hidden_state_layer_ids",
    "q_proj.weight": "hidden_size, num_attention_heads, head_dim", "o_proj.weight": "num_attention_heads, head_dim",
    "k_proj.weight": "hidden_size, num_key_value_heads, head_dim", "v_proj.weight": "num_key_value_heads, head_dim",
    "gate_proj.weight": "intermediate_size", "up_proj.weight": "intermediate_size",
    "down_proj.weight": "intermediate_size",
    "lm_head.inner.weight": "draft_vocab_size, hidden_size", "embed_tokens.weight": "vocab_size, hidden_size",
}


def load_eagle3(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu") -> Eagle3Model:
    """The EAGLE-3 head at `path`: a checkpoint folder (or its config.json or weights file), or a `.gguf` file."""
    path = Path(path)
    if not path.exists():
        raise SpecdraftError(f"--trained {path}: no such file or folder (an EAGLE-3 checkpoint folder with "
                             "config.json and model.safetensors, or its GGUF).")
    if path.suffix == ".gguf":
        config, tensors = read_gguf(path)
    else:
        config, tensors = read_folder(path if path.is_dir() else path.parent)
    return build_eagle3(config, tensors, str(path), dtype, device)


# ----- the checkpoint folder ------------------------------------------------------------------------------------
def read_folder(folder: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """The config and tensors (ours by name; `d2t` as published: offsets) of a SpecForge or speculators folder."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpecdraftError(f"{folder} has no config.json: an EAGLE-3 checkpoint folder holds config.json and its "
                             "weights (model.safetensors).")
    return from_published(json.loads(config_file.read_text()), read_weights(folder), str(folder))


def from_published(raw: dict, published: dict[str, torch.Tensor],
                   where: str = "EAGLE-3 head") -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """The config and tensors (ours by name) of a checkpoint's config.json `raw` and its tensors by their
    published names."""
    tensors, unknown = {}, []
    for name, value in published.items():
        ours = _our_name(name)
        if ours is None:
            if name not in IGNORED:
                unknown.append(name)
        else:
            tensors[ours] = value
    if unknown:
        raise SpecdraftError(f"{where}: tensors an EAGLE-3 head does not have: {', '.join(sorted(unknown))}. This "
                             "reads one-layer EAGLE-3 heads (SpecForge midlayer.*, speculators layers.0.*).")
    return config_from_json(raw, tensors, where), tensors


def _our_name(name: str) -> str | None:
    """Our name for a published tensor name, None for one we do not know."""
    if name in TOP_NAMES:
        return name
    if re.fullmatch(r"fc_norm\.\d+\.weight", name):
        return name
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            return LAYER_NAMES.get(name[len(prefix):])
    return None


def _layer_config(raw: dict) -> tuple[object, str]:
    """The decoder layer's transformers config (defaults filled, as the sources build it) and the format's name."""
    from transformers import AutoConfig, LlamaConfig

    nested = raw.get("transformer_layer_config")
    if nested is None:  # SpecForge builds its draft from a LlamaConfig of the flat file
        return LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}), "specforge"
    kind = nested.get("model_type", "qwen3")  # speculators' default layer class is Qwen3's
    try:
        layer_class = type(AutoConfig.for_model(kind))
    except ValueError:
        raise SpecdraftError(f"The speculators config's transformer_layer_config is a {kind!r} layer, which "
                             "this transformers does not know.") from None
    return layer_class(**{k: v for k, v in nested.items() if k != "model_type"}), "speculators"


def config_from_json(raw: dict, tensors: dict[str, torch.Tensor], where: str) -> Eagle3Config:
    """The head's config from its config.json (either format) and its tensors (for what only they tell)."""
    layer, source = _layer_config(raw)
    if getattr(layer, "num_hidden_layers", 1) != 1:
        raise SpecdraftError(f"{where}: this head has {layer.num_hidden_layers} decoder layers; the eagle3 drafter "
                             "runs the one-layer heads SpecForge and speculators publish.")
    if getattr(layer, "hidden_act", "silu") != "silu":
        raise SpecdraftError(f"{where}: hidden_act {layer.hidden_act!r}; EAGLE-3 heads use silu.")
    hidden = layer.hidden_size
    heads = layer.num_attention_heads
    head_dim = getattr(layer, "head_dim", None) or hidden // heads
    target_hidden = raw.get("target_hidden_size") or hidden
    if "fc.weight" not in tensors:
        raise SpecdraftError(f"{where}: no fc.weight (the fused feature projection, [hidden_size, 3 * "
                             "target_hidden_size]): this is not an EAGLE-3 head (an EAGLE-1/2 head has no aux layers).")
    fused = tensors["fc.weight"].shape[-1]
    if fused % target_hidden:
        raise SpecdraftError(f"{where}: fc.weight reads {fused} features, not a multiple of target_hidden_size "
                             f"{target_hidden}; set target_hidden_size in config.json to the target's hidden size.")
    if source == "speculators":
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        flags = {"norm_before_residual": bool(raw.get("norm_before_residual", False)),
                 "norm_before_fc": bool(raw.get("norm_before_fc", False)), "fc_norm": bool(raw.get("fc_norm", False)),
                 "feed_normed": bool(raw.get("norm_output", False)), "logits_normed": True}
    else:
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        sglang_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is None and sglang_ids is not None:
            aux = [i + 1 for i in sglang_ids]  # SGLang captures layer i's output: transformers' hidden_states[i + 1]
        flags = {"norm_before_residual": bool(raw.get("norm_before_residual", False)),
                 "norm_before_fc": bool(raw.get("norm_before_fc", False)), "fc_norm": bool(raw.get("fc_norm", False)),
                 "feed_normed": False, "logits_normed": bool(raw.get("norm_output", True))}
    vocab = layer.vocab_size
    return Eagle3Config(
        hidden_size=hidden, target_hidden_size=target_hidden, num_heads=heads,
        num_kv_heads=getattr(layer, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate_size=layer.intermediate_size, draft_vocab_size=raw.get("draft_vocab_size") or vocab,
        vocab_size=vocab, rms_eps=layer.rms_norm_eps, num_aux=fused // target_hidden,
        aux_layers=tuple(aux) if aux else None, attention_bias=bool(getattr(layer, "attention_bias", False)),
        qk_norm="q_norm.weight" in tensors or getattr(layer, "model_type", "") == "qwen3",
        own_embeddings="embed_tokens.weight" in tensors, rope_parameters=dict(layer.rope_parameters or {}),
        source=source, **flags)


# ----- the GGUF --------------------------------------------------------------------------------------------------
def read_gguf(path: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """The config and tensors (ours by name, unpacked to float32; q and k rows back in transformers' order; `d2t`
    as offsets) of the GGUF llama.cpp's converter makes of an EAGLE-3 head."""
    header = read_header(path)
    if header.architecture != "eagle3":
        raise SpecdraftError(f"{path.name} is a {header.architecture!r} GGUF, not an EAGLE-3 head (architecture "
                             "eagle3, from convert_hf_to_gguf.py --target-model-dir).")

    def key(name: str, default=None):
        return header.get(f"eagle3.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or hidden // heads)
    source, tensors, unknown, factors = _TensorFile(path), {}, [], None
    try:
        for entry in header.tensors:
            if entry.name == "d2t":
                raw = source.rows(entry).reshape(-1).view(torch.int64)  # [draft vocab] absolute target ids
                tensors["d2t"] = raw - torch.arange(raw.shape[0])  # as published: offsets
            elif entry.name == "rope_freqs.weight":
                factors = tuple(source.unpacked(entry, torch.float32).tolist())
            elif entry.name in GGUF_NAMES:
                value = source.unpacked(entry, torch.float32)
                ours = GGUF_NAMES[entry.name]
                if ours.startswith(("q_proj", "k_proj")):  # llama.cpp's rotary row order -> transformers'
                    value = value[_rotary_row_order(value.shape[0], heads if ours.startswith("q") else kv_heads)]
                tensors[ours] = value
            else:
                unknown.append(entry.name)
    finally:
        source.close()
    if unknown:
        raise SpecdraftError(f"{path.name}: tensors an EAGLE-3 GGUF does not have: {', '.join(sorted(unknown))}.")
    if "fc.weight" not in tensors:
        raise SpecdraftError(f"{path.name}: no fc.weight; convert the head again with convert_hf_to_gguf.py.")
    target_hidden = int(key("target_hidden_size", 0) or hidden)
    layers = key("target_layers")
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    elif scaling not in (None, "none"):
        raise SpecdraftError(f"{path.name}: rope scaling {scaling!r}; the eagle3 drafter reads none, linear and "
                             "Llama 3's (rope_freqs) from a GGUF. Use the checkpoint folder instead.")
    vocab = int(key("vocab_size", 0) or (tensors["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in tensors
                                         else 0))
    rows = tensors["d2t"] if "d2t" in tensors else tensors.get("lm_head.weight", torch.empty(0))
    draft_vocab = int(rows.shape[0])
    config = Eagle3Config(
        hidden_size=hidden, target_hidden_size=target_hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=int(key("feed_forward_length")), draft_vocab_size=draft_vocab,
        vocab_size=vocab or draft_vocab, rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        num_aux=tensors["fc.weight"].shape[1] // target_hidden,
        aux_layers=tuple(int(i) for i in layers) if layers else None,
        norm_before_residual=bool(key("norm_before_residual", False)),
        norm_before_fc=bool(key("norm_before_fc", False)),
        attention_bias="q_proj.bias" in tensors, own_embeddings="embed_tokens.weight" in tensors,
        rope_parameters=rope, rope_factors=factors, source="gguf")
    return config, tensors


# ----- both ------------------------------------------------------------------------------------------------------
def draft_to_target_ids(config: Eagle3Config, tensors: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    """Each draft id's target id `[draft vocab]` (j + d2t[j]), checked: in the target's vocabulary, no id twice."""
    count = config.draft_vocab_size
    d2t = tensors.get("d2t")
    if d2t is None:
        if count != config.vocab_size:
            raise SpecdraftError(f"{where}: the draft vocabulary ({count} tokens) is smaller than the target's "
                                 f"({config.vocab_size}) but the checkpoint has no d2t map back to target ids.")
        return torch.arange(count)
    if d2t.shape != (count,):
        raise SpecdraftError(f"{where}: d2t has shape {tuple(d2t.shape)}; draft_vocab_size is {count}.")
    ids = torch.arange(count) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise SpecdraftError(f"{where}: d2t maps draft tokens outside the target's vocabulary of {config.vocab_size} "
                             "(vocab_size in config.json): a head for another target?")
    if ids.unique().shape[0] != count:
        raise SpecdraftError(f"{where}: d2t maps two draft tokens to one target token.")
    return ids


def build_eagle3(config: Eagle3Config, tensors: dict[str, torch.Tensor], where: str,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> Eagle3Model:
    """The model of `config` holding `tensors` (ours by name, `lm_head.weight` and `d2t` as published), checked."""
    with torch.device("meta"):
        model = Eagle3Model(config)
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    state = {name: value for name, value in tensors.items() if name not in ("lm_head.weight", "d2t")}
    if "lm_head.weight" in tensors:  # rows sorted by target id: the SubsetHead's layout
        ids = draft_to_target_ids(config, tensors, where)
        order = ids.argsort()
        state["lm_head.inner.weight"] = tensors["lm_head.weight"][order]
        state["lm_head.ids"] = ids[order]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise SpecdraftError(f"{where}: missing tensors {', '.join(missing)} (as named in "
                             "specdraft.models.eagle3; published with a midlayer. / layers.0. prefix for the layer's).")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise SpecdraftError(f"{where}: tensors {', '.join(extra)} that this head's config.json does not declare "
                             "(check attention_bias, norm_before_fc, fc_norm and the layer's model_type).")
    check_shapes(state, expected, SHAPE_KEYS, where)
    model.load_state_dict({name: value.to(dtype) if value.is_floating_point() else value
                           for name, value in state.items()}, assign=True)
    return model.to(device).eval().requires_grad_(False)
