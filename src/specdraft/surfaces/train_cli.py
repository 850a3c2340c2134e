"""`specdraft train ...`: build self-distillation data and train drafters on it (thin; the work is in training/)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape  # a message's own [brackets] (pip install 'x[extra]') are no markup
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdraft.errors import SpecdraftError
from specdraft.models import registry

train_app = typer.Typer(no_args_is_help=True,
                        help="Train drafters for a target: data, medusa, eagle, eagle3, distill.")
err = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(str(message))}", highlight=False)
    raise typer.Exit(2)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err)


def default_training_prompts() -> list[Path]:
    """Spec-Bench questions (where this checkout has them) and the package's code tasks."""
    from specdraft.training.data import CODE_TASKS

    spec_bench = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
    return ([spec_bench.resolve()] if spec_bench.is_file() else []) + [CODE_TASKS]


@train_app.command("data")
def data(
    out: Path = typer.Option(..., "--out", help="Folder for the data (an existing one is resumed)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target: bundled name, HF folder or .gguf file."),
    prompts: Optional[List[Path]] = typer.Option(None, "--prompts", help="Spec-Bench style JSONL files (repeat the "
                                                 "option; default: Spec-Bench's questions and our code tasks)."),
    holdout: int = typer.Option(5, "--holdout", help="Leave out the first N prompts of each category of each file "
                                                    "(benchmarks take the first ones)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Continuation length per prompt."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts generated together (one shard each batch)."),
    top_k: int = typer.Option(8, "--top-k", help="Target log-probabilities kept per position."),
    max_prompt_tokens: int = typer.Option(1024, "--max-prompt-tokens", help="Skip prompts longer than this."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N training prompts."),
    texts: Optional[List[Path]] = typer.Option(None, "--texts", help="Build from plain text instead: files or "
                                               "folders of .py/.md/.rst/.txt files (repeat the option); nothing "
                                               "is generated, each piece is one teacher-forced pass."),
    max_tokens: int = typer.Option(200_000, "--max-tokens", help="With --texts: tokens to build in all."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="With --texts: tokens per sequence."),
    seed: int = typer.Option(0, help="With --texts: the seed that shuffles the files."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: torch's)."),
) -> None:
    """The target's own greedy continuations (or, with --texts, plain text) with its final hidden states
    and top log-probabilities (resumable)."""
    import torch

    from specdraft.models.loading import load_model
    from specdraft.training.data import build_dataset, build_text_dataset, text_files, training_prompts

    if threads:
        torch.set_num_threads(threads)
    try:
        if texts:
            text_files(texts)  # a wrong path fails before the model loads
            lm = load_model(target)
            with _progress() as bar:
                task = bar.add_task("tokens", total=max_tokens)
                built = build_text_dataset(lm, texts, out, max_tokens, chunk_tokens, top_k=top_k, seed=seed,
                                           progress=lambda done, total: bar.update(task, completed=done))
        else:
            chosen = training_prompts(prompts or default_training_prompts(), holdout)[:limit]
            lm = load_model(target)
            with _progress() as bar:
                task = bar.add_task("prompts", total=len(chosen))
                built = build_dataset(lm, chosen, out, max_new_tokens, batch_size, top_k, max_prompt_tokens,
                                      progress=lambda done, total: bar.update(task, completed=done, total=total))
    except SpecdraftError as error:
        _fail(str(error))
    err.print(f"{out}: {built.num_sequences} sequences, {built.num_tokens} tokens", highlight=False)


@train_app.command("vocab")
def vocab(
    texts: List[Path] = typer.Option(..., "--texts", help="Files, or folders of .py/.md/.rst/.txt files (repeat the option)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Model whose tokenizer counts (bundled name, HF folder "
                               "or .gguf file); its draft shares it."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Stop after this many tokens (default: all)."),
    seed: int = typer.Option(0, help="The seed that shuffles the files (matters with --max-tokens)."),
    out: Optional[Path] = typer.Option(None, "--out", help="File to write (default: the cache folder, where "
                                       "`--draft-vocab` finds counts for this tokenizer)."),
) -> None:
    """Count how often each token occurs in plain text: the ranking `--draft-vocab` keeps a draft's head to
    (half by these counts, then the lowest ids)."""
    from specdraft.models.loading import load_tokenizer
    from specdraft.models.token_counts import made_counts_path, save_token_counts
    from specdraft.training.data import count_tokens, text_files

    try:
        files = text_files(texts)
        tokenizer = load_tokenizer(target)
        with _progress() as bar:
            task = bar.add_task("files", total=len(files))
            counts, total = count_tokens(files, tokenizer, len(tokenizer), max_tokens, seed,
                                         progress=lambda done, all_files: bar.update(task, completed=done))
        out = out or made_counts_path(tokenizer)
        save_token_counts(out, counts, tokenizer, {"target": target, "texts": [str(t) for t in texts],
                                                   "files": len(files), "tokens": total, "seed": seed})
    except SpecdraftError as error:
        _fail(str(error))
    err.print(f"{out}: {total} tokens from {len(files)} files, {int((counts > 0).sum())} distinct", highlight=False)


def _train_config(steps, learning_rate, batch_tokens, eval_every, max_minutes, seed, warmup_steps=50):
    from specdraft.training.loop import TrainConfig

    return TrainConfig(steps=steps, learning_rate=learning_rate, batch_tokens=batch_tokens, eval_every=eval_every,
                       checkpoint_every=eval_every, max_minutes=max_minutes, seed=seed, warmup_steps=warmup_steps)


def _run_training(kind: str, data: List[Path], out: Path, target: str, device: str, threads: Optional[int], **fit) -> None:
    import torch

    from specdraft.models.loading import load_model
    from specdraft.training.data import SelfDistillData
    from specdraft.training.drafters import train_eagle, train_eagle3, train_medusa

    if threads:
        torch.set_num_threads(threads)
    trainer = {"medusa": train_medusa, "eagle": train_eagle, "eagle3": train_eagle3}[kind]
    try:
        fit["config"].check()  # a wrong option fails before the model loads
        dataset = SelfDistillData(*data)
        lm = load_model(target, device=device)
        trainer(lm, dataset, out, log=lambda line: err.print(line, highlight=False), **fit)
    except SpecdraftError as error:
        _fail(str(error))


_DATA = typer.Option(..., "--data", help="A folder built by `specdraft train data` (repeat the option to train "
                                        "on several).")
_TARGET = typer.Option(registry.DEFAULT_TARGET, help="The target the data was built with.")
_STEPS = typer.Option(2000, "--steps", help="Optimizer steps.")
_LR = typer.Option(1e-3, "--learning-rate", help="Peak learning rate (warm-up, then cosine to a tenth).")
_BATCH = typer.Option(1024, "--batch-tokens", help="Target positions per step.")
_EVAL = typer.Option(200, "--eval-every", help="Held-out evaluation and checkpoint every N steps.")
_MINUTES = typer.Option(None, "--max-minutes", help="Stop (and save) after this long.")
_VOCAB = typer.Option(32768, "--vocab", help="Tokens the drafter's head scores (the data's, then the commonest).")
_INIT = typer.Option(None, "--init", help="Go on training this drafter file (its shape and vocabulary win "
                     "over --width/--heads/--vocab...).")
_DEVICE = typer.Option("auto", help="auto (CUDA when present), cpu or cuda.")
_THREADS = typer.Option(None, "--threads", help="torch threads (default: torch's).")


@train_app.command("medusa")
def medusa(
    data: List[Path] = _DATA,
    out: Path = typer.Option(..., "--out", help="The .safetensors file to write (a checkpoint beside it resumes)."),
    target: str = _TARGET,
    heads: int = typer.Option(4, "--heads", help="Medusa heads (draft depth)."),
    rank: int = typer.Option(256, "--rank", help="Width of each head's residual block."),
    vocab: int = _VOCAB, steps: int = _STEPS, learning_rate: float = _LR, batch_tokens: int = _BATCH,
    eval_every: int = _EVAL, max_minutes: Optional[float] = _MINUTES, seed: int = typer.Option(0, help="Seed."),
    init: Optional[Path] = _INIT, device: str = _DEVICE, threads: Optional[int] = _THREADS,
) -> None:
    """Medusa heads on the target's last hidden state, sharing its (frozen) LM head."""
    config = _train_config(steps, learning_rate, batch_tokens, eval_every, max_minutes, seed)
    _run_training("medusa", data, out, target, device, threads, config=config, num_heads=heads, rank=rank, vocab=vocab,
                  init=init)


@train_app.command("eagle")
def eagle(
    data: List[Path] = _DATA,
    out: Path = typer.Option(..., "--out", help="The .safetensors file to write (a checkpoint beside it resumes)."),
    target: str = _TARGET,
    width: int = typer.Option(768, "--width", help="Width of the drafter's decoder layer (a multiple of 128)."),
    intermediate: int = typer.Option(2048, "--intermediate", help="Its MLP's inner width."),
    vocab: int = _VOCAB, steps: int = _STEPS, learning_rate: float = _LR, batch_tokens: int = _BATCH,
    eval_every: int = _EVAL, max_minutes: Optional[float] = _MINUTES, seed: int = typer.Option(0, help="Seed."),
    init: Optional[Path] = _INIT, device: str = _DEVICE, threads: Optional[int] = _THREADS,
) -> None:
    """An EAGLE feature drafter: one decoder layer over (target feature, next token embedding)."""
    config = _train_config(steps, learning_rate, batch_tokens, eval_every, max_minutes, seed)
    _run_training("eagle", data, out, target, device, threads, config=config, width=width,
                  intermediate_size=intermediate, vocab=vocab, init=init)


@train_app.command("eagle3")
def eagle3(
    data: List[Path] = _DATA,
    out: Path = typer.Option(..., "--out", help="The folder to write, in SpecForge's format (config.json, "
                             "model.safetensors); its checkpoint OUT.checkpoint.pt beside it resumes."),
    target: str = _TARGET,
    intermediate: Optional[int] = typer.Option(None, "--intermediate", help="The layer's MLP width (default: the "
                                               "target's, as SpecForge makes it)."),
    vocab: int = typer.Option(32000, "--vocab", help="Draft vocabulary: the data's commonest tokens (and the "
                              "special ones), as d2t/t2d."),
    ttt_length: int = typer.Option(7, "--ttt-length", help="Steps of the training-time test: the head's own "
                                   "outputs fed back this many times."),
    with_embeddings: bool = typer.Option(False, "--with-embeddings", help="Also write a copy of the target's "
                                         "embeddings (embed_tokens.weight) into the folder."),
    keep_target_gb: float = typer.Option(4.0, "--keep-target-gb", help="Memory for the target's states of the "
                                         "sequences trained on, so later epochs skip its passes (0: none)."),
    steps: int = _STEPS, learning_rate: float = typer.Option(1e-4, "--learning-rate", help="Peak learning rate "
                                                             "(warm-up, then cosine to a tenth)."),
    batch_tokens: int = _BATCH, eval_every: int = _EVAL, max_minutes: Optional[float] = _MINUTES,
    seed: int = typer.Option(0, help="Seed."), device: str = _DEVICE, threads: Optional[int] = _THREADS,
) -> None:
    """An EAGLE-3 head (SpecForge's recipe): fc over three target layers, one decoder layer, a reduced vocabulary;
    loads with --drafter eagle3 --trained OUT. Run it again to go on from its checkpoint."""
    config = _train_config(steps, learning_rate, batch_tokens, eval_every, max_minutes, seed)
    _run_training("eagle3", data, out, target, device, threads, config=config, intermediate_size=intermediate,
                  vocab=vocab, ttt_length=ttt_length, with_embeddings=with_embeddings, keep_target_gb=keep_target_gb)


@train_app.command("distill")
def distill(
    data: List[Path] = _DATA,
    out: Path = typer.Option(..., "--out", help="The model folder to write (a checkpoint beside it resumes)."),
    draft: str = typer.Option(registry.DEFAULT_DRAFT, "--draft", help="The draft to distil: bundled name, HF "
                              "folder or .gguf file (GGUF weights are unpacked to train)."),
    layers: int = typer.Option(4, "--layers", help="Train the draft's last N decoder layers (and its final norm)."),
    steps: int = typer.Option(400, "--steps", help="Optimizer steps."),
    learning_rate: float = typer.Option(5e-5, "--learning-rate", help="Peak learning rate (warm-up, then cosine "
                                        "to a tenth)."),
    batch_tokens: int = typer.Option(512, "--batch-tokens", help="Continuation positions per step."),
    warmup: int = typer.Option(20, "--warmup", help="Warm-up steps."),
    eval_every: int = _EVAL, max_minutes: Optional[float] = _MINUTES, seed: int = typer.Option(0, help="Seed."),
    device: str = _DEVICE, threads: Optional[int] = _THREADS,
) -> None:
    """Fine-tune a draft model towards the target's distributions (forward KL on the target's continuations)."""
    import torch

    from specdraft.models.loading import load_model
    from specdraft.training.data import SelfDistillData
    from specdraft.training.distill import train_distill

    if threads:
        torch.set_num_threads(threads)
    config = _train_config(steps, learning_rate, batch_tokens, eval_every, max_minutes, seed, warmup)
    try:
        config.check()
        dataset = SelfDistillData(*data)
        lm = load_model(draft, device=device, gguf_weights="unpacked", prepack=False)
        train_distill(lm, dataset, out, config, layers, log=lambda line: err.print(line, highlight=False))
    except SpecdraftError as error:
        _fail(str(error))
