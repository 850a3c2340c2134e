"""Reading a published DFlash draft (z-lab's `DFlashDraftModel` checkpoints, e.g. `z-lab/Qwen3-4B-DFlash-b16`)
into a `dflash.DFlashModel`.

The folder: `config.json` is a Qwen3 config of the draft (`num_hidden_layers` draft layers, `hidden_size` the
target's) with `block_size`, `num_target_layers` and `dflash_config` (`target_layer_ids`, `mask_token_id`); the
weights (model.safetensors or shards) are `fc.weight` `[H, len(ids) * H]`, `hidden_norm.weight`, `norm.weight` and
`layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
mlp.{gate,up,down}_proj}` (names as the model saves them; a `model.` prefix, as llama.cpp's converter adds, is
accepted). The draft has no embeddings or head of its own: it reads the target's. Without `target_layer_ids` the
layers are the source's default (`build_target_layer_ids`: one in the middle for one draft layer, else evenly from 1
to L - 3). Not read: sliding-window layers, DFlash2 / DSpark extensions (selector, conv), `mask_embedding.pt`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.checkpoint_tensors import DECODER_LAYER_NAMES, check_shapes, read_weights
from specdraft.models.dflash import DFlashConfig, DFlashModel

LAYER_NAME = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")
TOP_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"}


def default_target_layers(target_layers: int, draft_layers: int) -> list[int]:
    """The source's `build_target_layer_ids`: which target layers' outputs feed `fc` when the config names none."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]


def load_dflash(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu") -> DFlashModel:
    """The DFlash draft at `path`: its checkpoint folder (or its config.json or weights file)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise SpecdraftError(f"--trained {path}: no config.json there (a DFlash checkpoint folder holds config.json "
                             "and model.safetensors).")
    config, tensors = from_published(json.loads((folder / "config.json").read_text()), read_weights(folder),
                                     str(folder))
    return build_dflash(config, tensors, str(folder), dtype, device)


def from_published(raw: dict, published: dict[str, torch.Tensor], where: str = "DFlash draft"
                   ) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """The config and tensors (ours by name) of a DFlash config.json `raw` and its tensors by published name."""
    from transformers import Qwen3Config

    tensors, unknown = {}, []
    for name, value in published.items():
        match = LAYER_NAME.fullmatch(name)
        if match and match.group(2) in DECODER_LAYER_NAMES:
            tensors[f"layers.{match.group(1)}.{DECODER_LAYER_NAMES[match.group(2)]}"] = value
        elif name.removeprefix("model.") in TOP_NAMES:
            tensors[name.removeprefix("model.")] = value
        else:
            unknown.append(name)
    if unknown:
        raise SpecdraftError(f"{where}: tensors a DFlash draft does not have: {', '.join(sorted(unknown))} (this reads "
                             "z-lab's DFlashDraftModel: fc, hidden_norm, norm and Qwen3 layers).")
    extra = raw.get("dflash_config") or {}
    if raw.get("use_sliding_window") or extra.get("use_swa") or "conv_kernel_size" in extra:
        raise SpecdraftError(f"{where}: a DFlash draft with sliding-window or DFlash2 layers, which this drafter "
                             "does not run.")
    mask = extra.get("mask_token_id")
    if mask is None:
        raise SpecdraftError(f"{where}: config.json has no dflash_config.mask_token_id (the block's mask token).")
    layer = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")})
    ids = extra.get("target_layer_ids") or raw.get("target_layer_ids")
    if not ids:
        if not raw.get("num_target_layers"):
            raise SpecdraftError(f"{where}: config.json names neither dflash_config.target_layer_ids nor "
                                 "num_target_layers.")
        ids = default_target_layers(int(raw["num_target_layers"]), layer.num_hidden_layers)
    heads = layer.num_attention_heads
    config = DFlashConfig(
        hidden_size=layer.hidden_size, num_heads=heads, num_kv_heads=layer.num_key_value_heads or heads,
        head_dim=getattr(layer, "head_dim", None) or layer.hidden_size // heads,
        intermediate_size=layer.intermediate_size, num_layers=layer.num_hidden_layers, vocab_size=layer.vocab_size,
        block_size=int(extra.get("block_size") or raw.get("block_size") or 16), mask_token_id=int(mask),
        target_layers=tuple(int(i) + 1 for i in ids), rms_eps=layer.rms_norm_eps,
        attention_bias=bool(layer.attention_bias), rope_parameters=dict(layer.rope_parameters or {}), source=where)
    return config, tensors


def build_dflash(config: DFlashConfig, tensors: dict[str, torch.Tensor], where: str,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> DFlashModel:
    """The model of `config` holding `tensors` (ours by name), checked by name and shape."""
    with torch.device("meta"):
        model = DFlashModel(config)
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        raise SpecdraftError(f"{where}: missing tensors {', '.join(missing)} (num_hidden_layers is "
                             f"{config.num_layers}).")
    if extra:
        raise SpecdraftError(f"{where}: tensors {', '.join(extra)} that its config.json does not declare (check "
                             "num_hidden_layers and attention_bias).")
    check_shapes(tensors, expected, None, where)
    model.load_state_dict({name: value.to(dtype) for name, value in tensors.items()}, assign=True)
    return model.to(device).eval().requires_grad_(False)
