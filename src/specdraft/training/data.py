"""Self-distillation data: the target's own continuations, with its final hidden states and top logits.

For each training prompt the target writes a greedy continuation (prompts run in batches of
similar length: on the CPU a pass over 8 tokens costs little more than one), then one
teacher-forced pass over prompt + continuation records, at every position t:

- `hidden[t]`: the target's final hidden state (after the last norm: what its LM head reads),
  the feature Medusa heads and the EAGLE drafter learn from;
- `top_ids[t]`, `top_logprobs[t]`: the target's K most likely next tokens and their
  log-probabilities, the soft labels of distillation.

A data folder holds `manifest.json` and shards `shard-NNNNN.safetensors`, each with
`tokens [N]`, `hidden [N, H]` (bf16), `top_ids [N, K]`, `top_logprobs [N, K]` (fp16) and
`offsets [S + 1]`, `prompt_lengths [S]` for its S sequences. A shard is written whole (to a
temporary name, then renamed) before the manifest names it, so an interrupted build resumes
where it stopped and never reads half a shard.

Held-out prompts: the first `holdout` prompts of every category of every prompts file are
never used (benchmarks take the first prompts of each category), so evaluation stays unseen.

Text data (`build_text_dataset`): the same records over chunks of plain text files (source code,
documentation) instead of the target's continuations. Nothing is generated, so a token costs one
teacher-forced position, not a decoding step: several times more data per hour on the CPU, at the
price of text the target did not write (its features and distributions are still the target's).
Its sequences have `prompt_length` 0: every position is a training position.

EAGLE-3 reads only the tokens of either kind of data: the states of the three target layers it fuses and the
target's logits over its draft vocabulary come from a teacher-forced pass as it trains (`target_layer_states`),
so data built for the other drafters serves it unchanged and nothing 3 x hidden wide is stored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from specdraft.prompts import Prompt, load_prompt_files
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.text import encode_prompt

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DEFAULT_HOLDOUT = 5  # prompts per category kept out of training (benchmarks use the first 2-3)
DEFAULT_TOP_K = 8
# Programming tasks of our own for training only (the benchmark's code prompts are never trained on).
CODE_TASKS = Path(__file__).parent / "data" / "code_tasks.jsonl"


def training_prompts(paths: Sequence[str | Path], holdout: int = DEFAULT_HOLDOUT) -> list[Prompt]:
    """The prompts of `paths` less the first `holdout` of every category of every file."""
    if holdout < 0:
        raise SpecdraftError(f"--holdout must be >= 0, got {holdout}.")
    kept = []
    for path in paths:
        taken: dict[str, int] = {}
        for prompt in load_prompt_files([path]):
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            if taken[prompt.category] > holdout:
                kept.append(Prompt(f"{Path(path).stem}:{prompt.question_id}", prompt.category, prompt.turns))
    if not kept:
        raise SpecdraftError(f"No training prompts are left once {holdout} per category are held out.")
    return kept


@dataclass
class DistillSequence:
    """One training sequence: prompt + the target's continuation, with the target's features."""

    tokens: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, H] bf16: final hidden state at each position (predicts tokens[t + 1])
    top_ids: torch.Tensor  # [T, K] int64
    top_logprobs: torch.Tensor  # [T, K] float32
    prompt_length: int


class SelfDistillData:
    """One or more built data folders (built for the same target), read shard by shard, in order."""

    def __init__(self, folder: str | Path, *more: str | Path) -> None:
        self.folders = [Path(folder), *map(Path, more)]
        self.manifests = [self._read_manifest(path) for path in self.folders]
        for path, manifest in zip(self.folders[1:], self.manifests[1:]):
            differing = [key for key in ("target", "hidden_size", "vocab_size")
                         if manifest.get(key) != self.manifest.get(key)]
            if differing:
                raise SpecdraftError(f"{path} was built with another {', '.join(differing)} than {self.folders[0]}; "
                                     "train on data built for one target.")

    @staticmethod
    def _read_manifest(folder: Path) -> dict:
        path = folder / MANIFEST
        if not path.is_file():
            raise SpecdraftError(f"{folder} holds no training data ({MANIFEST} is missing); build it with "
                                 "`specdraft train data --out FOLDER`.")
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT_VERSION:
            raise SpecdraftError(f"{path} is in format {manifest.get('format')!r}; this version reads "
                                 f"{FORMAT_VERSION}. Build the data again.")
        return manifest

    @property
    def folder(self) -> str:
        """The folders, for messages and summaries."""
        return ", ".join(map(str, self.folders))

    @property
    def manifest(self) -> dict:
        """The first folder's manifest (the settings every folder shares)."""
        return self.manifests[0]

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def _shards(self) -> Iterator[tuple[Path, dict]]:
        for folder, manifest in zip(self.folders, self.manifests):
            for shard in manifest["shards"]:
                yield folder, shard

    @property
    def num_sequences(self) -> int:
        return sum(len(shard["prompts"]) for _, shard in self._shards())

    @property
    def num_tokens(self) -> int:
        return sum(int(shard["tokens"]) for _, shard in self._shards())

    def sequences(self) -> Iterator[DistillSequence]:
        """Every sequence, folder by folder and shard by shard, in build order."""
        for folder, shard in self._shards():
            data = load_file(str(folder / shard["file"]))
            offsets = data["offsets"].tolist()
            for i, prompt_length in enumerate(data["prompt_lengths"].tolist()):
                rows = slice(offsets[i], offsets[i + 1])
                yield DistillSequence(data["tokens"][rows].long(), data["hidden"][rows], data["top_ids"][rows].long(),
                                data["top_logprobs"][rows].float(), int(prompt_length))

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the data (prompts and continuations). # [vocab_size] int64"""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for sequence in self.sequences():
            counts += torch.bincount(sequence.tokens, minlength=vocab_size)[:vocab_size]
        return counts


@torch.inference_mode()
def greedy_continuations(target: CausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt, all in one left-padded batch (ending at
    its first end-of-sequence token, which is kept)."""
    model, device = target.model, target.device
    eos = sorted(target.eos_token_ids)
    pad = eos[0] if eos else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)  # [B, W]
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, device=device)
        mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, eos_token_id=eos or None, top_k=None, top_p=None, temperature=None)
    continuations = []
    for row in out[:, width:].tolist():  # [B, new]
        ends = [i for i, token in enumerate(row) if token in eos]
        continuations.append(row[: ends[0] + 1] if ends else row)
    return continuations


@torch.inference_mode()
def target_features(target: CausalLM, tokens: list[int], top_k: int, chunk: int = 256, prompt: bool = False):
    """One teacher-forced pass: final hidden states `[T, H]` and the top-k next-token log-probabilities `[T, K]`.
    `prompt`: run it as a prompt pass (faster on CPUs with VNNI; see `CausalLM.forward`)."""
    target.reset()
    try:
        out = target.forward(torch.tensor([tokens], device=target.device), logits_to_keep=len(tokens),
                             hidden_to_keep=len(tokens), prompt=prompt)
    finally:
        target.reset()
    hidden, logits = out.hidden_states[0], out.logits[0]  # [T, H], [T, V]
    top_ids, top_logprobs = [], []
    for start in range(0, logits.shape[0], chunk):
        logprobs = torch.log_softmax(logits[start:start + chunk].float(), dim=-1)  # [c, V]
        values, indices = logprobs.topk(top_k, dim=-1)
        top_ids.append(indices)
        top_logprobs.append(values)
    return hidden.to(torch.bfloat16).cpu(), torch.cat(top_ids).cpu(), torch.cat(top_logprobs).cpu()


@torch.no_grad()  # not inference mode: the states feed a head being trained
def target_layer_states(target: CausalLM, tokens: torch.Tensor, ids: torch.Tensor, chunk: int = 128):
    """One teacher-forced prompt pass over `tokens` `[T]`, `chunk` tokens a pass, returning at every position the
    states `target.feature_layers` names side by side `[T, n * H]` (a drafter must claim them with
    `read_features_at`), the logits of the tokens `ids` `[T, len(ids)]` float32, and the target's most likely next
    token over its whole vocabulary `[T]`. What EAGLE-3 learns from, computed as it trains (nothing is stored)."""
    target.reset()
    states, logits, top = [], [], []
    try:
        for start in range(0, tokens.shape[0], chunk):
            piece = tokens[start:start + chunk].to(target.device).unsqueeze(0)  # [1, c]
            out = target.forward(piece, logits_to_keep=piece.shape[1], hidden_to_keep=piece.shape[1], prompt=True)
            states.append(out.hidden_states[0])  # [c, n * H]
            logits.append(out.logits[0][:, ids])  # [c, N]
            top.append(out.logits[0].argmax(-1))  # [c]
    finally:
        target.reset()
    return torch.cat(states), torch.cat(logits), torch.cat(top)


def _write_manifest(folder: Path, manifest: dict) -> None:
    temporary = folder / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, folder / MANIFEST)


def _open_folder(out: str | Path, settings: dict) -> tuple[Path, dict, set[str]]:
    """(folder, manifest, names of the sequences already built) for a build with `settings`, resuming
    the folder's manifest when it was built with the same settings."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT_VERSION, **settings, "shards": []}
    if (folder / MANIFEST).is_file():
        manifest = json.loads((folder / MANIFEST).read_text())
        differing = [key for key, value in settings.items() if manifest.get(key) != value]
        if differing:
            raise SpecdraftError(f"{folder} holds data built with other settings ({', '.join(differing)}); "
                                 "give another --out or the same settings to resume.")
    return folder, manifest, {name for shard in manifest["shards"] for name in shard["prompts"]}


def _write_shard(folder: Path, manifest: dict, names: list[str], parts: list[tuple], generated: int) -> None:
    """Write one shard of `parts` (tokens, prompt length, hidden, top ids, top log-probabilities per
    sequence, named `names`) whole, then name it in the manifest."""
    lengths = [len(tokens) for tokens, *_ in parts]
    name = f"shard-{len(manifest['shards']):05d}.safetensors"
    tensors = {
        "tokens": torch.tensor([t for tokens, *_ in parts for t in tokens], dtype=torch.int32),
        "hidden": torch.cat([hidden for _, _, hidden, _, _ in parts]).contiguous(),
        "top_ids": torch.cat([ids for *_, ids, _ in parts]).to(torch.int32).contiguous(),
        "top_logprobs": torch.cat([lp for *_, lp in parts]).to(torch.float16).contiguous(),
        "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        "prompt_lengths": torch.tensor([n for _, n, *_ in parts], dtype=torch.int64),
    }
    save_file(tensors, str(folder / (name + ".tmp")))
    os.replace(folder / (name + ".tmp"), folder / name)
    manifest["shards"].append({"file": name, "prompts": names, "tokens": sum(lengths), "generated": generated})
    _write_manifest(folder, manifest)


def _target_settings(target: CausalLM) -> dict:
    """What data built for `target` must share with it."""
    return {"target": target.name, "hidden_size": int(target.config.hidden_size), "vocab_size": target.vocab_size}


def _require_at_least(*checks: tuple[str, int, int]) -> None:
    """Refuse any (option name, value, least allowed) whose value is below its least, naming the option."""
    for name, value, least in checks:
        if value < least:
            raise SpecdraftError(f"--{name} must be >= {least}, got {value}.")


def build_dataset(
    target: CausalLM,
    prompts: Sequence[Prompt],
    out: str | Path,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    top_k: int = DEFAULT_TOP_K,
    max_prompt_tokens: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> SelfDistillData:
    """Build (or resume) a self-distillation folder at `out` from `prompts` (first turns, through the
    chat template). Each batch becomes one shard; prompts longer than `max_prompt_tokens` are skipped.
    `progress(done, total)` is called after each shard."""
    _require_at_least(("max-new-tokens", max_new_tokens, 1), ("batch-size", batch_size, 1), ("top-k", top_k, 1),
                      ("max-prompt-tokens", max_prompt_tokens, 1))
    folder, manifest, done = _open_folder(out, {**_target_settings(target), "top_k": top_k,
                                                "max_new_tokens": max_new_tokens})
    encoded = []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.turns[0])
        if len(ids) <= max_prompt_tokens:
            encoded.append((str(prompt.question_id), ids))
    todo = sorted([(qid, ids) for qid, ids in encoded if qid not in done], key=lambda item: len(item[1]))
    finished = len(encoded) - len(todo)
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        continuations = greedy_continuations(target, [ids for _, ids in batch], max_new_tokens)
        parts = [(ids + cont, len(ids), *target_features(target, ids + cont, top_k))
                 for (_, ids), cont in zip(batch, continuations)]
        _write_shard(folder, manifest, [qid for qid, _ in batch], parts, sum(len(c) for c in continuations))
        finished += len(batch)
        if progress is not None:
            progress(finished, len(encoded))
    return SelfDistillData(folder)


TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")


def text_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files named by `paths`: files as given, folders searched for TEXT_SUFFIXES files, sorted."""
    files = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()))
        else:
            raise SpecdraftError(f"--texts {path}: no such file or folder.")
    if not files:
        raise SpecdraftError(f"--texts {', '.join(map(str, paths))}: no {'/'.join(TEXT_SUFFIXES)} files there.")
    return files


def encoded_files(files: Sequence[Path], tokenizer, seed: int = 0) -> Iterator[tuple[Path, list[int]]]:
    """(file, its token ids) for every one of `files`, in an order shuffled by `seed` (so that any prefix
    of the stream mixes many files)."""
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    for index in order:
        text = files[index].read_text(encoding="utf-8", errors="replace")
        yield files[index], tokenizer.encode(text, add_special_tokens=False)


def count_tokens(files: Sequence[Path], tokenizer, vocab_size: int, max_tokens: int | None = None, seed: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, int]:
    """(how often each token id occurs in `files`, tokens counted): the files in an order shuffled by `seed`,
    stopping after the file that reaches `max_tokens` (None: all). counts: [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    total = 0
    for done, (_, ids) in enumerate(encoded_files(files, tokenizer, seed), 1):
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
        total += len(ids)
        if progress is not None:
            progress(done, len(files))
        if max_tokens is not None and total >= max_tokens:
            break
    return counts, total


def text_chunks(files: Sequence[Path], tokenizer, chunk_tokens: int, seed: int = 0) -> Iterator[tuple[str, list[int]]]:
    """(name, token ids) of every `chunk_tokens`-long piece of `files` (a shorter last piece is kept
    when it has a quarter of that), the files in the order of `encoded_files`. Names (`path:index`)
    identify pieces when a build resumes."""
    min_tokens = max(8, chunk_tokens // 4)
    for path, ids in encoded_files(files, tokenizer, seed):
        for start in range(0, len(ids), chunk_tokens):
            piece = ids[start:start + chunk_tokens]
            if len(piece) >= min_tokens:
                yield f"{path}:{start // chunk_tokens}", piece


def build_text_dataset(
    target: CausalLM,
    paths: Sequence[str | Path],
    out: str | Path,
    max_tokens: int,
    chunk_tokens: int = 512,
    per_shard: int = 16,
    top_k: int = DEFAULT_TOP_K,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> SelfDistillData:
    """Build (or resume) a data folder at `out` from plain text: up to `max_tokens` tokens of the files
    under `paths`, in pieces of `chunk_tokens`, each one teacher-forced prompt pass of the target
    (`per_shard` pieces to a shard). `progress(tokens done, max_tokens)` is called after each shard."""
    _require_at_least(("max-tokens", max_tokens, 1), ("chunk-tokens", chunk_tokens, 16), ("per-shard", per_shard, 1),
                      ("top-k", top_k, 1))
    if target.tokenizer is None:
        raise SpecdraftError(f"{target.name} has no tokenizer; text data needs one.")
    chunk_tokens = min(chunk_tokens, target.max_context)
    folder, manifest, done = _open_folder(out, {**_target_settings(target), "top_k": top_k, "source": "texts",
                                                "chunk_tokens": chunk_tokens, "seed": seed})
    built = sum(int(shard["tokens"]) for shard in manifest["shards"])
    names, parts = [], []
    for name, ids in text_chunks(text_files(paths), target.tokenizer, chunk_tokens, seed):
        if built >= max_tokens:
            break
        if name in done:
            continue
        names.append(name)
        parts.append((ids, 0, *target_features(target, ids, top_k, prompt=True)))
        built += len(ids)
        if len(parts) == per_shard or built >= max_tokens:
            _write_shard(folder, manifest, names, parts, generated=0)
            names, parts = [], []
            if progress is not None:
                progress(min(built, max_tokens), max_tokens)
    if parts:
        _write_shard(folder, manifest, names, parts, generated=0)
        if progress is not None:
            progress(min(built, max_tokens), max_tokens)
    return SelfDistillData(folder)
