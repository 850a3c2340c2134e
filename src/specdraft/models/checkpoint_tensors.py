"""What the checkpoint loaders of the one-layer heads share (`eagle3_loading`, `mtp_loading`, `dflash_loading`): the
names a published decoder layer (transformers' Llama and Qwen-3 layers) gives its tensors, after the layer's prefix,
and ours (each loader adds the names only its checkpoints have); reading a folder's weights; the check of the
tensors' shapes against the config.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specdraft.errors import SpecdraftError

DECODER_LAYER_NAMES = {  # published name (after the layer's prefix) -> ours
    "input_layernorm.weight": "input_layernorm.weight", "post_attention_layernorm.weight":
    "post_attention_layernorm.weight", "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight", "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight", "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.bias": "k_proj.bias", "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.bias": "o_proj.bias", "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight", "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight", "mlp.down_proj.weight": "down_proj.weight",
}


def read_safetensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors named `prefix`... (by the name after it) in the folder's safetensors: model.safetensors, the
    shards model.safetensors.index.json names for them, or every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({file for name, file in weight_map.items() if name.startswith(prefix)})
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as handle:
            tensors.update({key[len(prefix):]: handle.get_tensor(key) for key in handle.keys()
                            if key.startswith(prefix)})
    return tensors


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights: its safetensors (`read_safetensors`), or else pytorch_model.bin (read
    as weights only)."""
    tensors = read_safetensors(folder)
    if not tensors and (folder / "pytorch_model.bin").is_file():
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if not tensors:
        raise SpecdraftError(f"{folder} has no weights: put the head's model.safetensors (or pytorch_model.bin) "
                             "beside its config.json.")
    return tensors


def check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                 shape_keys: dict[str, str] | None, where: str) -> None:
    """Refuse a tensor (ours by name) whose shape is not the `expected` one, naming the config keys that set it
    (`shape_keys`, hidden_size where it names none; None: no keys named). Every expected name is in `tensors`."""
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            keys = "" if shape_keys is None else f" (from {shape_keys.get(name, 'hidden_size')})"
            raise SpecdraftError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, the config asks for "
                                 f"{shape}{keys}; the config.json and the weights disagree.")
