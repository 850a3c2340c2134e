"""Train a Medusa or EAGLE drafter for a target from its self-distillation data, and write it out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import SubsetHead, common_token_ids, target_subset_head
from specdraft.models.eagle import EagleConfig, EagleDrafterModel
from specdraft.models.medusa import MedusaConfig, MedusaHeads
from specdraft.models.trained import load_trained, save_trained
from specdraft.training.data import SelfDistillData
from specdraft.training.loop import TrainConfig, train
from specdraft.training.objectives import EagleObjective, MedusaObjective

DEFAULT_DRAFT_VOCAB = 32768  # tokens a trained drafter's head scores (the data's, then the commonest ids)


def drafter_vocab_head(target: CausalLM, data: SelfDistillData, keep: int) -> SubsetHead:
    """The target's LM head over `keep` tokens: every token of the data, then the lowest ids, plus specials."""
    if keep < 1:
        raise SpecdraftError(f"--vocab must be >= 1, got {keep}.")
    if data.manifest["hidden_size"] != target.config.hidden_size or data.manifest["vocab_size"] != target.vocab_size:
        raise SpecdraftError(f"The data in {data.folder} was built for {data.manifest['target']!r} (hidden size "
                             f"{data.manifest['hidden_size']}, vocabulary {data.manifest['vocab_size']}), not for "
                             f"{target.name!r}.")
    always = set(target.eos_token_ids)
    if target.tokenizer is not None:
        always.update(target.tokenizer.all_special_ids)
    ids = common_token_ids(data.token_counts(target.vocab_size), min(keep, target.vocab_size), always)
    return target_subset_head(target, ids)


def _warm_start(kind: str, init: str | Path, target: CausalLM,
                log: Callable[[str], None]) -> tuple[torch.nn.Module, SubsetHead]:
    """A trained `kind` drafter to go on training (its shape and vocabulary win over the options)."""
    trained = load_trained(init, kind, target.name, target.config.hidden_size, torch.float32, target.device)
    module = trained.module.train().requires_grad_(True)
    log(f"starting from {init}: {module.config.to_json()}, {len(trained.vocab_ids)} tokens")
    return module, target_subset_head(target, trained.vocab_ids)


def _fit(kind: str, module: torch.nn.Module, objective, target: CausalLM, data: SelfDistillData, out: Path,
         config: TrainConfig, log: Callable[[str], None], init: str | Path | None = None) -> Path:
    checkpoint = out.with_name(out.name + ".checkpoint.pt")
    summary = train(objective, data, checkpoint, config, log)
    summary["data"] = str(data.folder)
    if init:
        summary["init"] = str(init)
    path = save_trained(out, kind, module, objective.vocab_head.ids.cpu(), target.name, summary)
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return path


def train_medusa(target: CausalLM, data: SelfDistillData, out: str | Path, config: TrainConfig,
                 num_heads: int = 4, rank: int = 256, vocab: int = DEFAULT_DRAFT_VOCAB,
                 log: Callable[[str], None] = print, init: str | Path | None = None) -> Path:
    """Train Medusa heads on `data` and write them to `out` (a checkpoint beside it allows resuming);
    `init`: go on from trained heads instead of fresh ones."""
    if num_heads < 1 or rank < 1:
        raise SpecdraftError(f"--heads and --rank must be >= 1, got {num_heads} and {rank}.")
    torch.manual_seed(config.seed)
    if init:
        heads, vocab_head = _warm_start("medusa", init, target, log)
    else:
        heads = MedusaHeads(MedusaConfig(target.config.hidden_size, num_heads, rank)).to(target.device)
        vocab_head = drafter_vocab_head(target, data, vocab)
    objective = MedusaObjective(heads, vocab_head)
    return _fit("medusa", heads, objective, target, data, Path(out), config, log, init)


def train_eagle(target: CausalLM, data: SelfDistillData, out: str | Path, config: TrainConfig,
                width: int = 768, intermediate_size: int = 2048, vocab: int = DEFAULT_DRAFT_VOCAB,
                log: Callable[[str], None] = print, init: str | Path | None = None) -> Path:
    """Train an EAGLE drafter on `data` and write it to `out` (a checkpoint beside it allows resuming);
    `init`: go on from a trained drafter instead of a fresh one."""
    if width < 128 or width % 128 or intermediate_size < 1:
        raise SpecdraftError(f"--width must be a multiple of 128 and --intermediate >= 1; got {width}, "
                             f"{intermediate_size}.")
    torch.manual_seed(config.seed)
    if init:
        model, vocab_head = _warm_start("eagle", init, target, log)
    else:
        rope_theta = float(getattr(target.config, "rope_theta", None)
                           or (getattr(target.config, "rope_parameters", None) or {}).get("rope_theta", 1e6))
        heads = width // 128  # attention heads of 128 dimensions, sharing keys and values in pairs where they can
        model_config = EagleConfig(target.config.hidden_size, width, num_heads=heads,
                                   num_kv_heads=math.gcd(heads, 2), intermediate_size=intermediate_size,
                                   rope_theta=rope_theta)
        model = EagleDrafterModel(model_config).to(target.device)
        vocab_head = drafter_vocab_head(target, data, vocab)
    objective = EagleObjective(model, vocab_head, target.model.get_input_embeddings())
    return _fit("eagle", model, objective, target, data, Path(out), config, log, init)
