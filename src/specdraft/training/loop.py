"""The training loop every trained drafter shares: batches of sequences, AdamW, held-out
evaluation, checkpoints and resume, a time limit.

An `Objective` owns the module being trained and knows its loss; the loop knows nothing of
Medusa or EAGLE. Every 20th sequence of the data (by build order) is held out for
evaluation, so held-out accuracy is measured on prompts the module never trained on.
Randomness (batch order, feature noise) flows from one seeded `torch.Generator`, saved in
the checkpoint, so a resumed run continues the same sequence of batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.training.data import DistillSequence, SelfDistillData

HELD_OUT_EVERY = 20  # every 20th sequence is held out
# Settings a resumed run must share with its checkpoint (steps and the time limit may change).
RESUME_MUST_MATCH = ("learning_rate", "batch_tokens", "warmup_steps", "seed")


@dataclass(frozen=True)
class TrainConfig:
    """How long and how fast to train."""

    steps: int = 2000
    learning_rate: float = 1e-3
    batch_tokens: int = 1024  # target positions per optimizer step
    warmup_steps: int = 50
    eval_every: int = 200
    checkpoint_every: int = 200
    max_minutes: float | None = None  # stop (and save) once this much time has passed
    seed: int = 0

    def check(self) -> None:
        """Refuse values that cannot train, naming the option."""
        for name, value in (("steps", self.steps), ("batch-tokens", self.batch_tokens),
                            ("eval-every", self.eval_every), ("checkpoint-every", self.checkpoint_every)):
            if value < 1:
                raise SpecdraftError(f"--{name} must be >= 1, got {value}.")
        if self.warmup_steps < 0:
            raise SpecdraftError(f"--warmup must be >= 0, got {self.warmup_steps}.")
        if not self.learning_rate > 0:
            raise SpecdraftError(f"--learning-rate must be > 0, got {self.learning_rate}.")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise SpecdraftError(f"--max-minutes must be > 0, got {self.max_minutes}.")


class Objective(Protocol):
    """What the loop trains: a module, its loss on one sequence, and held-out metrics."""

    module: nn.Module

    def loss(self, sequence: DistillSequence, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        """(summed loss over the sequence's positions, how many positions)."""

    def evaluate(self, sequences: list[DistillSequence]) -> dict[str, float]:
        """Held-out metrics (e.g. top-1 accuracy per head)."""


def split(data: SelfDistillData) -> tuple[list[DistillSequence], list[DistillSequence]]:
    """(training, held-out) sequences: every `HELD_OUT_EVERY`-th is held out."""
    train, held_out = [], []
    for index, sequence in enumerate(data.sequences()):
        (held_out if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(sequence)
    if not train or not held_out:
        raise SpecdraftError(f"The data holds {len(train) + len(held_out)} sequences; training needs at least "
                             f"{HELD_OUT_EVERY} (one is held out of every {HELD_OUT_EVERY}). Build more data.")
    return train, held_out


def _learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(objective: Objective, data: SelfDistillData, checkpoint: Path, config: TrainConfig,
          log: Callable[[str], None] = print) -> dict:
    """Train `objective.module` on `data`, resuming from `checkpoint` when it exists; returns a summary
    (steps, tokens seen, seconds, the last held-out metrics). The checkpoint is rewritten every
    `checkpoint_every` steps and at the end."""
    config.check()
    train_set, held_out = split(data)
    module = objective.module
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    step, tokens_seen, seconds = 0, 0, 0.0
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        changed = [key for key in RESUME_MUST_MATCH if state["config"][key] != getattr(config, key)]
        if changed:
            raise SpecdraftError(f"{checkpoint} was written with another {', '.join(changed)}; delete it or give "
                                 "the same settings to resume.")
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        step, tokens_seen, seconds = state["step"], state["tokens_seen"], state["seconds"]
        log(f"resumed from {checkpoint} at step {step}")

    def save() -> None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        temporary = checkpoint.with_name(checkpoint.name + ".tmp")
        torch.save({"config": asdict(config), "module": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(), "step": step, "tokens_seen": tokens_seen,
                    "seconds": seconds}, temporary)
        temporary.replace(checkpoint)

    metrics: dict[str, float] = {}
    started = time.perf_counter() - seconds
    module.train()
    while step < config.steps:
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(config, step)
        optimizer.zero_grad(set_to_none=True)
        total, positions = 0.0, 0
        while positions < config.batch_tokens:
            sequence = train_set[int(torch.randint(len(train_set), (1,), generator=generator))]
            loss, count = objective.loss(sequence, generator)
            if count == 0:
                continue
            (loss / config.batch_tokens).backward()
            total += float(loss.detach())
            positions += count
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        tokens_seen += positions
        seconds = time.perf_counter() - started
        if step % 10 == 0 or step == 1:
            log(f"step {step}/{config.steps}  loss {total / positions:.4f}  lr {_learning_rate(config, step):.2e}  "
                f"{tokens_seen / seconds:.0f} positions/s")
        out_of_time = config.max_minutes is not None and seconds > 60 * config.max_minutes
        if step % config.eval_every == 0 or step == config.steps or out_of_time:
            module.eval()
            metrics = objective.evaluate(held_out)
            module.train()
            log(f"step {step}  held-out " + "  ".join(f"{key} {value:.3f}" for key, value in metrics.items()))
        if step % config.checkpoint_every == 0 or step == config.steps or out_of_time:
            save()
        if out_of_time:
            log(f"stopping at step {step}: --max-minutes {config.max_minutes} reached")
            break
    module.eval()
    return {"steps": step, "positions_seen": tokens_seen, "seconds": round(seconds, 1), "held_out": metrics,
            "train_sequences": len(train_set), "held_out_sequences": len(held_out),
            "data_tokens": data.num_tokens, "config": asdict(config)}
