"""`specdraft check`: is this drafter, with these options, lossless on this model? (`analysis.check`)"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape  # a message's own [brackets] (pip install 'x[extra]') are no markup

from specdraft.analysis.check import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_TOP
from specdraft.errors import SpecdraftError

err = Console(stderr=True, soft_wrap=True, highlight=False)

# The options of `specdraft generate` that `check` takes as they are (declared once, in cli.generate), besides the
# drafters' own (declared once, in the registry).
SHARED_OPTIONS = ("target", "draft", "drafter", "k", "tree_budget", "tree_branch", "draft_quant", "draft_vocab",
                  "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "chat", "dtype", "device",
                  "gguf_weights", "context")
CHECK_PREFIX_BYTES = 64 << 20  # the check's prompts' rows, read once (where exact)
CHECK_PROMPTS = (  # short prompts of several kinds, when none are given
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about the sea.",
    "Translate to German: good morning, my friend.",
)


def check(
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="A prompt to check on (repeatable; default: "
                                               "four short prompts of different kinds)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="Spec-Bench-style JSONL: check on the "
                                                "first turn of its first --max-prompts questions."),
    max_prompts: int = typer.Option(4, "--max-prompts", min=1, help="At most this many prompts."),
    samples: int = typer.Option(400, "--samples", min=10, help="Sampled answers per prompt (more: a smaller bias "
                                "detectable; the verdict says how small)."),
    depth: int = typer.Option(DEFAULT_DEPTH, "--depth", min=1, max=4, help="Answer tokens tested per sample."),
    top: int = typer.Option(DEFAULT_TOP, "--top", min=1, help="Tokens with a cell of their own at each place "
                            "(the rest share an 'other' cell)."),
    alpha: float = typer.Option(DEFAULT_ALPHA, "--alpha", min=1e-12, max=0.5, help="The test's level: a lossless "
                                "setup fails this often by chance."),
    greedy_tokens: int = typer.Option(32, "--greedy-tokens", min=0, help="Tokens each greedy answer compares "
                                      "(0: no greedy check)."),
    batch: int = typer.Option(1, "--batch", min=1, help="1: the single-request engine (`generate`); N > 1: the "
                              "batched engine (`serve`), N answers at a time."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
    **model_options,
) -> None:
    """Check that speculative decoding with these options gives the target's own output: greedy answers equal to
    plain decoding, and (with --temperature > 0) sampled answers whose first tokens follow the target's exact
    distribution. Exits 0 when both pass, 1 when either fails."""
    try:
        passed = _check(prompt, prompts_file, max_prompts, samples, depth, top, alpha, greedy_tokens, batch, as_json,
                        model_options)
    except SpecdraftError as error:
        err.print(f"[bold red]error:[/] {escape(str(error))}")
        raise typer.Exit(2)
    raise typer.Exit(0 if passed else 1)


def _prompt_texts(prompt: list[str] | None, prompts_file: Path | None, max_prompts: int) -> list[str]:
    from specdraft.prompts import load_prompts

    if prompt and prompts_file is not None:
        raise SpecdraftError("Give prompts either with --prompt or with --prompts FILE, not both.")
    if prompts_file is not None:
        texts = [item.turns[0] for item in load_prompts(prompts_file)]
    else:
        texts = list(prompt or CHECK_PROMPTS)
    texts = [text for text in texts if text.strip()][:max_prompts]
    if not texts:
        raise SpecdraftError("No prompt to check on: give --prompt TEXT or a --prompts file with questions.")
    return texts


def _check(prompt, prompts_file, max_prompts, samples, depth, top, alpha, greedy_tokens, batch, as_json,
           model_options) -> bool:
    from specdraft.analysis.check import batched_answers, check_distribution, check_greedy, single_answers
    from specdraft.batch_engine import BatchedDecoder
    from specdraft.drafters import make_drafter
    from specdraft.engine import build_decoder, check_tree_options
    from specdraft.models.causal_lm import CausalLM
    from specdraft.policy import FixedK, make_policy
    from specdraft.prefix_cache import PrefixCache
    from specdraft.sampling import SamplingParams
    from specdraft.surfaces.model_setup import drafter_flags, load_models
    from specdraft.text import encode_prompt

    shared = {name: model_options.pop(name) for name in SHARED_OPTIONS}
    options = drafter_flags(**model_options)
    texts = _prompt_texts(prompt, prompts_file, max_prompts)
    check_tree_options(shared["tree_budget"], shared["tree_branch"])
    policy = make_policy(shared["k"], shared["tree_budget"])  # a bad --k fails before loading
    params = SamplingParams(temperature=shared["temperature"], top_k=shared["top_k"], top_p=shared["top_p"],
                            min_p=shared["min_p"], repetition_penalty=shared["repetition_penalty"],
                            seed=shared["seed"])
    drafter = shared["drafter"]
    target, draft = load_models(shared["target"], shared["draft"], drafter, options, dtype=shared["dtype"],
                                device=shared["device"], gguf_weights=shared["gguf_weights"],
                                draft_quant=shared["draft_quant"], draft_vocab=shared["draft_vocab"],
                                context=shared["context"])
    prompt_ids = [encode_prompt(target.tokenizer, text, chat=shared["chat"]) for text in texts]
    # each prompt is read once, where taking its rows again gives the bits of reading it (`prefix_cache`)
    prefixes = PrefixCache(CHECK_PREFIX_BYTES) if target.reads_split_exactly else None
    plain = single_answers(build_decoder(target, prefixes=prefixes))
    if batch > 1:
        def own_draft() -> CausalLM | None:  # each sequence's draft model: a cache of its own over the weights
            return None if draft is None else CausalLM(draft.model, draft.tokenizer, name=draft.name,
                                                       static_cache=False)

        engine = BatchedDecoder(target, lambda: make_drafter(drafter, options, draft_model=own_draft(),
                                                             target_model=target),
                                max_batch=batch, tree_budget=shared["tree_budget"], tree_branch=shared["tree_branch"])
        speculative = batched_answers(engine, policy.k if isinstance(policy, FixedK) else None)
    else:
        speculative = single_answers(build_decoder(target, drafter, options, draft_model=draft,
                                                   k=policy,
                                                   tree_budget=shared["tree_budget"],
                                                   tree_branch=shared["tree_branch"], prefixes=prefixes))
    report: dict = {"drafter": drafter, "k": str(shared["k"]), "prompts": len(prompt_ids), "engine":
                    "batched" if batch > 1 else "single"}
    passed = True
    if greedy_tokens:
        greedy = check_greedy(target, plain, speculative, prompt_ids, greedy_tokens)
        passed &= greedy.passed
        report["greedy"] = {"passed": greedy.passed, "equal": greedy.equal, "near_ties": greedy.near_ties,
                            "failed_prompt": greedy.failed_at}
        if not as_json:
            verdict = "[green]PASS[/]" if greedy.passed else "[bold red]FAIL[/]"
            where = "" if greedy.passed else f"; prompt {greedy.failed_at + 1} parted from plain decoding"
            err.print(f"greedy: {greedy.equal} of {greedy.prompts} prompts identical to plain decoding over "
                      f"{greedy_tokens} tokens, {greedy.near_ties} parted at a numerical near-tie{where}: {verdict}")
    if not params.greedy:
        result = check_distribution(target, speculative, prompt_ids, params, samples, depth, top, alpha,
                                    seed=params.seed)
        passed &= result.passed
        report["sampled"] = {"passed": result.passed, "samples": result.samples, "statistic": result.statistic,
                             "df": result.df, "p_value": result.pvalue, "alpha": alpha,
                             "detectable_total_variation": result.detectable, "power": result.power,
                             "impossible_answers": result.impossible}
        if not as_json:
            verdict = "[green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
            impossible = f", {result.impossible} answers the target can never give" if result.impossible else ""
            err.print(f"sampled: {result.samples} answers on {result.prompts} prompts, their first {depth} tokens "
                      f"against the target's exact distribution: chi-square {result.statistic:.1f} on {result.df} "
                      f"degrees of freedom, p = {result.pvalue:.3g} at α = {alpha:g}{impossible}: {verdict}")
            err.print(f"  power: any bias of total variation ≥ {result.detectable:.3f} in every prompt's cells is "
                      f"caught with probability {result.power:.0%} (more --samples catch smaller ones)")
    elif not as_json:
        err.print("sampled: not checked (--temperature 0 is greedy; give --temperature > 0 to test sampling)")
    report["passed"] = bool(passed)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        err.print("[bold green]lossless: no difference from the target found[/]" if passed else
                  "[bold red]NOT lossless: the output differs from the target's[/]")
    return bool(passed)
