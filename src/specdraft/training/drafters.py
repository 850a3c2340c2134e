"""Train a Medusa, EAGLE or EAGLE-3 drafter for a target from its self-distillation data, and write it out.

Medusa and EAGLE go to our own safetensors file (`models.trained`); EAGLE-3 to a SpecForge checkpoint folder
(`models.eagle3_saving`), which `--drafter eagle3 --trained DIR` loads as it loads a published head.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import SubsetHead, common_token_ids, target_subset_head
from specdraft.models.eagle import EagleConfig, EagleDrafterModel
from specdraft.models.eagle3 import Eagle3Config, Eagle3Model
from specdraft.models.eagle3_saving import save_specforge_folder
from specdraft.models.medusa import MedusaConfig, MedusaHeads
from specdraft.models.trained import load_trained, save_trained
from specdraft.training.data import SelfDistillData
from specdraft.training.loop import TrainConfig, train
from specdraft.training.objectives import Eagle3Objective, EagleObjective, MedusaObjective

DEFAULT_DRAFT_VOCAB = 32768  # tokens a trained drafter's head scores (the data's, then the commonest ids)
EAGLE3_DRAFT_VOCAB = 32000  # SpecForge's default draft_vocab_size
EAGLE3_TTT_LENGTH = 7  # SpecForge's default unrolled steps
EAGLE3_INIT_STD = 0.02  # transformers' initializer_range: every matrix starts N(0, 0.02), norms at one
TRAINING_SUMMARY = "specdraft-training.json"  # beside config.json in the folder: how the head was made


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


def fresh_eagle3_head(target: CausalLM, vocab_head: SubsetHead, intermediate_size: int | None,
                      generator: torch.Generator) -> Eagle3Model:
    """An EAGLE-3 head shaped as SpecForge shapes one for `target` (one decoder layer of the target's width, heads,
    norm epsilon and rotary; the default layers (2, L // 2, L - 3)), drawn from `generator`, its LM head over
    `vocab_head`'s tokens starting from the target's own rows (its output plays the target's final state's part)."""
    c = target.config
    if c.num_hidden_layers < 3:
        raise SpecdraftError(f"EAGLE-3 fuses the states entering target layers 2, L // 2 and L - 3 (SpecForge's "
                             f"choice); {target.name} has {c.num_hidden_layers} layers, too few.")
    heads = c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None)
                or {"rope_type": "default", "rope_theta": float(getattr(c, "rope_theta", None) or 10000.0)})
    config = Eagle3Config(hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, num_heads=heads,
                          num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                          head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                          intermediate_size=intermediate_size or c.intermediate_size,
                          draft_vocab_size=len(vocab_head.ids), vocab_size=target.vocab_size,
                          rms_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_parameters=rope, source="specforge")
    if config.intermediate_size < 1:
        raise SpecdraftError(f"--intermediate must be >= 1, got {config.intermediate_size}.")
    model = Eagle3Model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * EAGLE3_INIT_STD)
        model.lm_head.inner.weight.copy_(vocab_head.inner.weight.float().cpu())
        model.lm_head.ids.copy_(vocab_head.ids.cpu())
    return model.to(target.device).train().requires_grad_(True)


def train_eagle3(target: CausalLM, data: SelfDistillData, out: str | Path, config: TrainConfig,
                 intermediate_size: int | None = None, vocab: int = EAGLE3_DRAFT_VOCAB,
                 ttt_length: int = EAGLE3_TTT_LENGTH, with_embeddings: bool = False, keep_target_gb: float = 4.0,
                 log: Callable[[str], None] = print) -> Path:
    """Train an EAGLE-3 head on `data` (SpecForge's training-time test over `ttt_length` steps, a draft vocabulary
    of the data's `vocab` commonest tokens) and write it to the folder `out` in SpecForge's format. Its
    checkpoint `out.checkpoint.pt` beside the folder is rewritten as it trains, and a later run with the same
    settings goes on from it. `with_embeddings`: ship a copy of the target's embeddings in the folder (for runtimes
    that want them there; our loader takes the target's where the folder has none). `keep_target_gb`: memory for the
    target's states of the sequences trained on (`Eagle3Objective`), so later epochs skip the target's passes."""
    if ttt_length < 1:
        raise SpecdraftError(f"--ttt-length must be >= 1, got {ttt_length}.")
    if keep_target_gb < 0:
        raise SpecdraftError(f"--keep-target-gb must be >= 0 (0: run the target every epoch), got {keep_target_gb}.")
    out = Path(out)
    vocab_head = drafter_vocab_head(target, data, vocab)
    model = fresh_eagle3_head(target, vocab_head, intermediate_size, torch.Generator().manual_seed(config.seed))
    objective = Eagle3Objective(model, target, ttt_length, keep_bytes=int(keep_target_gb * 2**30))
    summary = train(objective, data, out.with_name(out.name + ".checkpoint.pt"), config, log)
    summary.update(data=str(data.folder), target=target.name, ttt_length=ttt_length)
    embeddings = None
    if with_embeddings:
        with torch.no_grad():  # through the module: a packed table too
            embeddings = target.model.get_input_embeddings()(torch.arange(target.vocab_size, device=target.device))
    save_specforge_folder(model, out, target.config.num_hidden_layers, target.max_context, embeddings,
                          {TRAINING_SUMMARY: summary})
    log(f"wrote {out} (SpecForge format; --drafter eagle3 --trained {out})")
    return out
