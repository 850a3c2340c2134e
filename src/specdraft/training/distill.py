"""Distil the target into a draft model (DistillSpec's recipe, on CPU-sized budgets).

The draft's last `layers` decoder layers and its final norm are trained (in float32, the
rest frozen in its loaded dtype) to minimise the forward KL from the target's stored
next-token distributions on the target's own continuations (`DistillObjective`). The result
is a Hugging Face model folder that `--draft FOLDER` loads like any other draft; it drafts
more like the target, and output stays exact whatever the draft is. Held-out agreement is
measured before training and after, and written to `specdraft-distill.json` in the folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.training.data import SelfDistillData
from specdraft.training.loop import TrainConfig, split, train
from specdraft.training.objectives import DistillObjective

SUMMARY = "specdraft-distill.json"


def trainable_part(draft: CausalLM, layers: int) -> torch.nn.ModuleList:
    """The draft's last `layers` decoder layers and final norm, made float32 and trainable; the rest frozen."""
    decoder = draft.model.model
    total = len(decoder.layers)
    if not 1 <= layers <= total:
        raise SpecdraftError(f"--layers must be between 1 and the draft's {total} layers, got {layers}.")
    draft.model.requires_grad_(False)
    part = torch.nn.ModuleList([*decoder.layers[total - layers:], decoder.norm]).float()
    part.requires_grad_(True)
    return part


def _write_folder(draft: CausalLM, out: Path, summary: dict) -> None:
    """Save the draft as a model folder at `out`, replacing what was there only once the new one is whole."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    draft.model.save_pretrained(str(partial))
    if draft.tokenizer is not None:
        draft.tokenizer.save_pretrained(str(partial))
    (partial / SUMMARY).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)


def train_distill(draft: CausalLM, data: SelfDistillData, out: str | Path, config: TrainConfig, layers: int = 4,
                  log: Callable[[str], None] = print) -> Path:
    """Fine-tune `draft` on the target's distributions in `data` and write it as a model folder at `out`
    (a checkpoint of the trained layers beside it allows resuming)."""
    if data.manifest["vocab_size"] != draft.vocab_size:
        raise SpecdraftError(f"The data in {data.folder} was built for {data.manifest['target']!r} (vocabulary "
                             f"{data.manifest['vocab_size']}); the draft {draft.name!r} has {draft.vocab_size} tokens.")
    out = Path(out)
    dtype = draft.dtype
    part = trainable_part(draft, layers)
    objective = DistillObjective(draft.model, part, draft.device)
    checkpoint = out.with_name(out.name + ".checkpoint.pt")
    before_file = out.with_name(out.name + ".before.json")
    if not checkpoint.is_file():  # held-out agreement of the draft as it came
        draft.model.eval()
        before_file.write_text(json.dumps(objective.evaluate(split(data)[1])))
    before = json.loads(before_file.read_text()) if before_file.is_file() else {}
    log("before training, held-out " + "  ".join(f"{key} {value:.3f}" for key, value in before.items()))
    summary = train(objective, data, checkpoint, config, log)
    part.to(dtype)
    summary.update(data=str(data.folder), draft=draft.name, target=data.manifest["target"], layers=layers,
                   held_out_before=before)
    _write_folder(draft, out, summary)
    log(f"wrote {out} (held-out agreement {before.get('agree', float('nan')):.3f} -> "
        f"{summary['held_out'].get('agree', float('nan')):.3f})")
    return out
