"""Reading the MTP layer a model's own checkpoint folder carries into an `mtp.MtpModel`.

The layout (DeepSeek-V3's, kept by GLM-4.5; what vLLM's `DeepSeekMTP` and llama.cpp's nextn tensor map
read): `config.json` says `num_nextn_predict_layers` (> 0), and the layers after the model's `num_hidden_layers`
L are the MTP layers. The first one, `model.layers.{L}.*`, holds

    enorm.weight, hnorm.weight [H]; eh_proj.weight [H, 2H]; shared_head.norm.weight [H]
    shared_head.head.weight [V, H], embed_tokens.weight [V, H]      (optional copies of the target's)
    input_layernorm, self_attn.{q,k,v,o}_proj (+ biases, q_norm / k_norm), post_attention_layernorm,
    mlp.{gate,up,down}_proj                                         (a dense decoder layer of the model's shape)

and is chained for every draft position (as llama.cpp's single-block MTP does); further MTP layers are not read. A
mixture-of-experts block (`mlp.experts.*`), DeepSeek's MLA attention or Qwen3-Next's `mtp.*` layout is refused by
name (MiMo-7B's `model.mtp_layers.*`, another layout, is not found). Every tensor is checked by name and shape
against the config before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.checkpoint_tensors import DECODER_LAYER_NAMES, check_shapes, read_safetensors
from specdraft.models.draft_head import SubsetHead, target_subset_head
from specdraft.models.mtp import MtpConfig, MtpModel

COUNT_KEYS = ("num_nextn_predict_layers",)  # DeepSeek-V3, GLM-4.5, MiMo
LAYER_NAMES = {  # published name (after model.layers.{L}.) -> ours
    **DECODER_LAYER_NAMES, "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "shared_head_norm.weight",
    "shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "embed_tokens.weight",
}
SHAPE_KEYS = {  # which config keys set each tensor's shape, for the error that names a misshapen one
    "q_proj.weight": "hidden_size, num_attention_heads, head_dim", "o_proj.weight": "num_attention_heads, head_dim",
    "k_proj.weight": "num_key_value_heads, head_dim", "v_proj.weight": "num_key_value_heads, head_dim",
    "gate_proj.weight": "intermediate_size", "up_proj.weight": "intermediate_size",
    "down_proj.weight": "intermediate_size", "lm_head.weight": "vocab_size, hidden_size",
    "embed_tokens.weight": "vocab_size, hidden_size",
}


def load_mtp(path: str | Path, target_head: torch.nn.Module | None = None, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu") -> MtpModel:
    """The first MTP layer of the checkpoint folder at `path` (or its config.json), scoring with the layer's own
    `shared_head.head` or else with `target_head` (the target's LM head: a linear `[V, H]`, shared, not copied, or a
    full-vocabulary `SubsetHead` such as `full_target_head(lm)` gives)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise SpecdraftError(f"--trained {path}: no config.json there. The mtp drafter reads the MTP layer a model's "
                             "own checkpoint folder carries (config.json with num_nextn_predict_layers, and "
                             "*.safetensors).")
    raw = json.loads((folder / "config.json").read_text())
    layer_index = mtp_layer_index(raw, str(folder))
    published = read_layer_tensors(folder, f"model.layers.{layer_index}.")
    config, tensors = from_published(raw, published, str(folder))
    return build_mtp(config, tensors, str(folder), target_head, dtype, device)


def mtp_layer_index(raw: dict, where: str) -> int:
    """Where the first MTP layer is kept (the model's layer count), checked: the config says it has some."""
    raw = {**raw, **(raw.get("text_config") or {})}
    count = next((int(raw[key]) for key in COUNT_KEYS if raw.get(key)), 0)
    if count <= 0:
        hint = (" (Qwen3-Next / Qwen3.5 keep theirs as mtp.* with gated attention, which this drafter does not run)"
                if raw.get("mtp_num_hidden_layers") else "")
        raise SpecdraftError(f"{where}: config.json declares no MTP layers (num_nextn_predict_layers){hint}; the mtp "
                             "drafter needs a model whose checkpoint carries them (the DeepSeek-V3 / GLM-4.5 "
                             "layout).")
    return int(raw["num_hidden_layers"])


def read_layer_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (the name after it) in the folder's safetensors (`read_safetensors`), at least one."""
    tensors = read_safetensors(folder, prefix)
    if not tensors:
        raise SpecdraftError(f"{folder}: config.json declares MTP layers but no weights are named {prefix}* (a "
                             "conversion that dropped them? transformers' save_pretrained does; MiMo-7B keeps its "
                             "own layout, model.mtp_layers.*, which this drafter does not read).")
    return tensors


def from_published(raw: dict, published: dict[str, torch.Tensor], where: str = "MTP layer"
                   ) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """The config and tensors (ours by name) of a model's config.json `raw` and its first MTP layer's tensors
    `published` (by their names after model.layers.{L}.)."""
    from transformers import AutoConfig

    tensors, unknown = {}, []
    for name, value in published.items():
        if name in LAYER_NAMES:
            tensors[LAYER_NAMES[name]] = value
        else:
            unknown.append(name)
    if any(name.startswith(("mlp.experts.", "mlp.gate.")) for name in unknown):
        raise SpecdraftError(f"{where}: its MTP block is a mixture of experts (mlp.experts.*); the mtp drafter runs "
                             "a dense Llama / Qwen decoder layer as the block.")
    if unknown:
        raise SpecdraftError(f"{where}: tensors an MTP layer of the DeepSeek-V3 layout with a dense Llama / Qwen block "
                             f"does not have: {', '.join(sorted(unknown))}.")
    kind = raw.get("model_type", "llama")
    try:
        layer = AutoConfig.for_model(kind, **{k: v for k, v in raw.items() if k != "model_type"})
    except ValueError:
        raise SpecdraftError(f"{where}: model_type {kind!r}, which this transformers does not know.") from None
    if getattr(layer, "hidden_act", "silu") != "silu":
        raise SpecdraftError(f"{where}: hidden_act {layer.hidden_act!r}; the MTP block runs silu.")
    heads = layer.num_attention_heads
    config = MtpConfig(
        hidden_size=layer.hidden_size, num_heads=heads,
        num_kv_heads=getattr(layer, "num_key_value_heads", None) or heads,
        head_dim=getattr(layer, "head_dim", None) or layer.hidden_size // heads,
        intermediate_size=layer.intermediate_size, vocab_size=layer.vocab_size, rms_eps=layer.rms_norm_eps,
        layer_index=int(raw["num_hidden_layers"]), qkv_bias="q_proj.bias" in tensors, o_bias="o_proj.bias" in tensors,
        qk_norm="q_norm.weight" in tensors, own_embeddings="embed_tokens.weight" in tensors,
        own_head="lm_head.weight" in tensors, rope_parameters=dict(getattr(layer, "rope_parameters", None) or {}),
        source=where)
    return config, tensors


def shared_head(head: torch.nn.Module, vocab_size: int) -> SubsetHead:
    """A full-vocabulary `SubsetHead` over a linear head's weight `[V, H]`, shared (a new parameter over the same
    storage, so nothing done to the drafter's touches the target's)."""
    if not isinstance(head, torch.nn.Linear):
        raise SpecdraftError("The mtp drafter shares the target's LM head, which must be a plain linear layer here "
                             "(a packed GGUF target's is not): use an unpacked target.")
    weight = head.weight.detach()
    with torch.device("meta"):
        subset = SubsetHead(torch.empty(vocab_size, weight.shape[1]), torch.arange(vocab_size), vocab_size)
    subset.inner.weight = torch.nn.Parameter(weight, requires_grad=False)
    if head.bias is not None:
        subset.inner.bias = torch.nn.Parameter(head.bias.detach(), requires_grad=False)
    subset.ids = torch.arange(vocab_size, device=weight.device)
    return subset


def full_target_head(lm: CausalLM) -> SubsetHead:
    """`lm`'s LM head over the whole vocabulary: its weight shared (`shared_head`) where it is a plain linear layer,
    else (a packed GGUF head) its rows computed once (`draft_head.target_subset_head`)."""
    head = lm.model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        return shared_head(head, lm.vocab_size)
    return target_subset_head(lm, torch.arange(lm.vocab_size))


def build_mtp(config: MtpConfig, tensors: dict[str, torch.Tensor], where: str,
              target_head: torch.nn.Module | None = None, dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str = "cpu") -> MtpModel:
    """The model of `config` holding `tensors` (ours by name), checked, with its head attached."""
    with torch.device("meta"):
        model = MtpModel(config)
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    if config.own_head:
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise SpecdraftError(f"{where}: its MTP layer lacks {', '.join(missing)} (as named in "
                             "specdraft.models.mtp; published under model.layers.{num_hidden_layers}.).")
    check_shapes(tensors, expected, SHAPE_KEYS, where)
    state = {name: value.to(dtype) for name, value in tensors.items() if name != "lm_head.weight"}
    model.load_state_dict(state, assign=True)
    model = model.to(device).eval().requires_grad_(False)
    if config.own_head:
        weight = tensors["lm_head.weight"].to(device=device, dtype=dtype)
        model.attach_head(SubsetHead(weight, torch.arange(config.vocab_size, device=device), config.vocab_size))
    elif isinstance(target_head, SubsetHead):
        model.attach_head(target_head)
    elif target_head is not None:
        model.attach_head(shared_head(target_head, config.vocab_size))
    else:
        raise SpecdraftError(f"{where}: its MTP layer has no shared_head.head; pass the target's LM head.")
    return model
