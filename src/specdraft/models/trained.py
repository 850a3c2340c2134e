"""Trained drafter weights on disk: one safetensors file per drafter, with what it was trained for.

The file holds the module's weights (bf16), `vocab_ids` (the tokens its head scores) and, in
the safetensors metadata, `kind` (medusa / eagle), `config` (the module's shape as JSON),
`target` (the target it was trained on), `hidden_size` and `training` (how it was made).
Weights shipped with the package live in `models/heads/<target>.<kind>.safetensors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specdraft.errors import SpecdraftError

SHIPPED = Path(__file__).parent / "heads"
KINDS = ("medusa", "eagle")


@dataclass
class TrainedDrafter:
    """A trained drafter module as read from disk."""

    kind: str
    module: nn.Module
    vocab_ids: torch.Tensor  # [kept] int64, sorted
    target: str
    training: dict


def save_trained(path: str | Path, kind: str, module: nn.Module, vocab_ids: torch.Tensor, target: str,
                 training: dict) -> Path:
    """Write `module` (its config must have `to_json`) and what it was trained for to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().to(torch.bfloat16).contiguous() for name, value in module.state_dict().items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int32).contiguous()
    metadata = {"kind": kind, "config": module.config.to_json(), "target": target,
                "hidden_size": str(module.config.hidden_size), "training": json.dumps(training)}
    temporary = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temporary), metadata=metadata)
    temporary.replace(path)
    return path


def shipped_path(target: str, kind: str) -> Path:
    """Where the package keeps the `kind` drafter trained for bundled target `target`."""
    return SHIPPED / f"{Path(target).name.removesuffix('.gguf')}.{kind}.safetensors"


def load_trained(path: str | Path | None, kind: str, target_name: str, hidden_size: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> TrainedDrafter:
    """Read a `kind` drafter from `path` (None or "": the one shipped for `target_name`) and check that it
    fits a target of `hidden_size`."""
    from specdraft.models.eagle import EagleConfig, EagleDrafterModel
    from specdraft.models.medusa import MedusaConfig, MedusaHeads

    if not path:
        path = shipped_path(target_name, kind)
        if not path.is_file():
            raise SpecdraftError(f"No {kind} drafter is shipped for {target_name!r}. Train one "
                                 f"(`specdraft train data`, then `specdraft train {kind}`) and pass --trained FILE.")
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"--trained {path}: no such file.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for a file that is not one
        raise SpecdraftError(f"--trained {path} is not a safetensors file of trained drafter weights: {error}") from None
    if metadata.get("kind") != kind:
        raise SpecdraftError(f"--trained {path} holds a {metadata.get('kind') or 'unknown'} drafter, not {kind}.")
    if int(metadata.get("hidden_size", -1)) != hidden_size:
        raise SpecdraftError(f"--trained {path} was trained for a target of hidden size {metadata.get('hidden_size')}; "
                             f"this target's is {hidden_size}. Train heads for this target.")
    config = {key: value for key, value in json.loads(metadata["config"]).items() if key != "kind"}
    module = MedusaHeads(MedusaConfig(**config)) if kind == "medusa" else EagleDrafterModel(EagleConfig(**config))
    vocab_ids = tensors.pop("vocab_ids").long().to(device)
    module.load_state_dict(tensors)
    module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return TrainedDrafter(kind, module, vocab_ids, metadata.get("target", ""), json.loads(metadata.get("training", "{}")))
