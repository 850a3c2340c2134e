"""The `specdraft` command line: thin, every algorithm lives below it."""

from __future__ import annotations

import dataclasses
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape  # a message's own [brackets] (pip install 'x[extra]') are no markup
from rich.table import Table
from rich.text import Text

from specdraft.drafters import DEFAULT_DRAFTER
from specdraft.analysis.costs import DEFAULT_CONTEXT as COST_CONTEXT, DEFAULT_REPEATS as COST_REPEATS, \
    DEFAULT_WIDTHS as COST_WIDTHS
from specdraft.analysis.diagnose import DIAGNOSE_K
from specdraft.engine import DEFAULT_K, DEFAULT_TREE_BRANCH
from specdraft.errors import SpecdraftError
from specdraft.extras import require
from specdraft.models import registry
from specdraft.paths import cache_dir

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lossless speculative decoding: same output as the target model, sooner.")
GGUF_WEIGHTS_OPTION = typer.Option(  # one definition for every command that loads models
    "auto", "--gguf-weights", help="GGUF files: packed (run the file's Q4_K/Q6_K blocks on CPU kernels), "
                                   "unpacked (to --dtype, as transformers loads them), or auto (packed on CPU).")
CONTEXT_OPTION = typer.Option(  # one definition for every command that holds its models to a context
    None, "--context", min=1, help="The longest sequence (prompt + answer) the models hold (default: each its own, a "
                                   "LongRoPE model's pretraining length; a draft holds at most what its positions "
                                   "allow). Past its pretraining length a LongRoPE model (Phi-3.5, Phi-4-mini) rotates "
                                   "every position with its long factors.")
err = Console(stderr=True, soft_wrap=True)

# Colour of each token by what happened to it.
KIND_STYLES = {"accepted": "green", "recovered": "yellow", "bonus": "cyan", "target": "", "forced": "magenta"}


class Method(str, Enum):
    spec = "spec"
    ar = "ar"


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(str(message))}", highlight=False)
    raise typer.Exit(code)


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The prompt (or use --prompt-file)."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from this file."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target: bundled name, HF folder or .gguf file."),
    draft: str = typer.Option(registry.DEFAULT_DRAFT, help="Draft model for the 'model' drafter."),
    method: Method = typer.Option(Method.spec, help="spec: speculative decoding; ar: plain decoding."),
    drafter: str = typer.Option(DEFAULT_DRAFTER, help="Drafter: a name from `specdraft drafters`, or parts joined "
                                                    "by + (ngram+model: prompt lookup first, the draft model otherwise)."),
    k: str = typer.Option(DEFAULT_K, "--k", help="Draft tokens per step: an integer, or auto (a cost model of this "
                                                "machine picks k each step, 0 when speculation would not pay)."),
    tree_budget: int = typer.Option(0, "--tree-budget", help="Draft tree nodes per step (0 = a chain); with --k "
                                    "auto the cost model picks up to this many, with a whole k the tree is at most k deep."),
    tree_branch: int = typer.Option(DEFAULT_TREE_BRANCH, "--tree-branch", help="Children per tree node (with --tree-budget)."),
    draft_quant: str = typer.Option("auto", "--draft-quant",
                                    help="Draft weights: int4 (CPU kernel), none, or auto (int4 on CPU). Output stays exact."),
    draft_vocab: str = typer.Option("auto", "--draft-vocab",
                                    help="Score only this many common tokens in the draft's LM head (0 = all; auto: 32768 "
                                         "on CPU where token counts exist for the tokenizer). Output stays exact."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    top_p: float = typer.Option(1.0, "--top-p", help="1 = off."),
    min_p: float = typer.Option(0.0, "--min-p", help="0 = off."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="1 = off."),
    seed: int = typer.Option(0, help="Seed of the run's torch.Generator (sample i uses seed + i)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Apply the chat template (default: if the model has one)."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="The answer is JSON valid under the "
                                               "schema in this file (output stays exact under the constraint)."),
    json_object: bool = typer.Option(False, "--json-object", help="The answer is a JSON object."),
    regex: Optional[str] = typer.Option(None, "--regex", help="The answer matches this regex (Rust regex syntax)."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help="The answer follows the grammar in this file "
                                           "(Lark or GBNF syntax)."),
    n: int = typer.Option(1, "--n", min=1, help="Independent samples."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    gguf_weights: str = GGUF_WEIGHTS_OPTION,
    context: Optional[int] = CONTEXT_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else."),
    **drafter_options,  # `--KEY` for every drafter option, declared once in the registry (`with_drafter_flags`)
) -> None:
    """Generate from a prompt, streaming tokens coloured by what happened to each."""
    try:
        _generate(**locals())
    except SpecdraftError as error:
        _fail(str(error))


def _generate(*, prompt, prompt_file, target, draft, method, drafter, k, tree_budget, tree_branch, draft_quant,
              draft_vocab, temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens, stop, chat,
              json_schema, json_object, regex, grammar, n, dtype, device, gguf_weights, context, as_json,
              drafter_options) -> None:
    from specdraft.constraints import Constraint
    from specdraft.engine import build_decoder, check_tree_options
    from specdraft.policy import make_policy
    from specdraft.stats import peak_memory_bytes
    from specdraft.sampling import SamplingParams
    from specdraft.stats import GenerationStats
    from specdraft.surfaces.model_setup import drafter_flags, load_models
    from specdraft.text import encode_prompt

    if prompt_file is not None:
        if prompt is not None:
            raise SpecdraftError("Give the prompt either as an argument or with --prompt-file, not both.")
        try:
            prompt = prompt_file.read_text()
        except OSError as error:
            raise SpecdraftError(f"Cannot read --prompt-file {prompt_file}: {error.strerror}.") from None
    if prompt is None or not prompt.strip():
        raise SpecdraftError("The prompt is empty; give some text (or --prompt-file with text in it).")
    check_tree_options(tree_budget, tree_branch)  # bad options fail before any loading
    constraint = Constraint.from_options(json_schema, regex, grammar, json_object)
    if constraint is not None:
        constraint.check()
    policy = make_policy(k, tree_budget) if method == Method.spec else None
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, seed=seed)

    options = drafter_flags(**drafter_options)
    target_lm, draft_lm = load_models(target, draft, drafter if method == Method.spec else None, options,
                                      dtype=dtype, device=device, gguf_weights=gguf_weights,
                                      draft_quant=draft_quant, draft_vocab=draft_vocab, context=context)
    decoder = build_decoder(target_lm, drafter if method == Method.spec else None, options, draft_model=draft_lm,
                            k=policy, tree_budget=tree_budget, tree_branch=tree_branch)

    prompt_ids = encode_prompt(target_lm.tokenizer, prompt, chat=chat)  # once, for every sample
    out = Console(highlight=False, soft_wrap=True)
    completions, total = [], GenerationStats()
    for i in range(n):
        stats = GenerationStats()
        run_sampling = dataclasses.replace(sampling, seed=seed + i)
        tokens, pieces, finish = [], [], "length"
        if n > 1 and not as_json:
            out.print(f"[bold]--- sample {i + 1} of {n} ---[/]")
        for event in decoder.stream(prompt_ids, run_sampling, max_new_tokens, stop, chat, stats,
                                    constraint=constraint):
            tokens += event.token_ids
            pieces.append(event.text)
            finish = event.finish_reason or finish
            if not as_json:
                for piece, kind in zip(event.pieces, event.kinds):
                    out.print(Text(piece, style=KIND_STYLES[kind]), end="")
        completions.append({"text": "".join(pieces), "token_ids": tokens, "finish_reason": finish})
        total = total.merge(stats) if i else stats
        if not as_json:
            out.print()
    summary = total.to_dict()
    peak_gb = peak_memory_bytes() / 1e9
    if as_json:
        sys.stdout.write(json.dumps({"method": method.value, "prompt_token_ids": prompt_ids,
                                     "completions": completions, "stats": summary,
                                     "peak_memory_gb": round(peak_gb, 3)}) + "\n")
        return
    alpha = "-" if total.acceptance_rate is None else f"{total.acceptance_rate:.2f}"
    tau = "-" if total.mean_committed_per_step is None else f"{total.mean_committed_per_step:.2f}"
    mean_k = "-" if total.mean_k is None else f"{total.mean_k:.1f}"
    err.print(
        f"[bold]{method.value}[/] {total.new_tokens} tokens in {total.wall_seconds:.2f}s = "
        f"[bold]{total.tokens_per_second:.1f} tok/s[/]  α={alpha}  τ={tau}  mean k={mean_k}  steps={total.steps}  "
        f"(draft {total.draft_seconds:.2f}s, verify {total.verify_seconds:.2f}s, prefill {total.prefill_seconds:.2f}s)"
        f"  peak memory {peak_gb:.2f} GB",
        highlight=False,
    )
    if total.forced_tokens:
        err.print(f"{total.forced_tokens} tokens forced by the constraint (no pass)", highlight=False)
    if method == Method.spec or total.forced_tokens:
        err.print("[green]accepted[/] [yellow]recovered[/] [cyan]bonus[/]" + (" [magenta]forced[/]" if constraint else ""),
                  highlight=False)


@app.command()
def models() -> None:
    """The bundled models: whether their packages are installed, the file assembled, and sizes."""
    table = Table(title="bundled models")
    table.add_column("name", no_wrap=True)
    for column in ("role", "packages", "assembled", "size"):
        table.add_column(column)
    for model in registry.BUNDLED_MODELS.values():
        installed = registry.packages_installed(model)
        assembled = registry.is_assembled(model)
        path = registry.assembled_path(model)
        size = f"{path.stat().st_size / 1e9:.2f} GB" if path.is_file() else "-"
        table.add_row(model.name, model.role, "installed" if installed else "missing",
                      "yes" if assembled else "no", size)
    Console().print(table)
    err.print(f"cache folder: {cache_dir()} (set SPECDRAFT_CACHE to move it)")


@app.command()
def kernels() -> None:
    """Build every native kernel this CPU runs (once; cached), and say which are ready and which level runs."""
    from specdraft.kernels import isa
    from specdraft.kernels.prebuild import build_all, in_use_text

    try:
        ready = {f"{level} library": runs for level, runs in build_all().items()}
        line = in_use_text()
        detected = isa.detected()
    except SpecdraftError as error:
        _fail(str(error))
    out = Console(highlight=False, soft_wrap=True)
    width = max(map(len, ready), default=0)
    for name, runs in ready.items():
        out.print(f"{name:<{width}}  " + ("[green]ready[/]" if runs else "[dim]does not run here[/]"))
    out.print(f"{line}; this CPU runs up to {detected}")
    err.print(f"built kernels are cached in {cache_dir() / 'kernels'}", highlight=False)


@app.command()
def drafters() -> None:
    """The registered drafters, one line each."""
    from specdraft.drafters import DRAFTERS

    out = Console(highlight=False)
    for name, info in DRAFTERS.items():
        if info.bench_only:
            continue
        options = ", ".join(f"--{key} ({option.default})" for key, option in info.options.items())
        out.print(f"[bold]{name}[/]  {info.description}" + (f"  [dim]options: {options}[/]" if options else ""))
    out.print("Compose with +: [bold]ngram+model[/] drafts by lookup where the text repeats, with the model elsewhere.")
    for name, info in DRAFTERS.items():  # measuring tools: `specdraft bench` methods only, never generate or serve
        if info.bench_only:
            options = ", ".join(f"{key}={option.default}" for key, option in info.options.items())
            out.print(f"[dim][bold]{name}[/bold]  {info.description}  method keys: {options}[/]")


@app.command()
def bench(
    prompts: Optional[list[Path]] = typer.Option(
        None, "--prompts", help="Spec-Bench JSONL (default: the shipped set); repeat to join files in one run."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma list of categories (default: all)."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts",
                                              help="At most N prompts per category, in file order."),
    turns: int = typer.Option(1, "--turns", help="1: the first turn of each question; 2: also the second turn of "
                              "multi-turn ones (as `<id>:turn2`), continuing the chat from ar's first reply."),
    methods: str = typer.Option("ar,spec", "--methods",
                                help="Comma list of NAME or NAME:key=value;key=value, NAME one of ar, spec, hf-ar, "
                                     "hf-assisted, hf-prompt-lookup, llama-cpp, llama-server, llama-server-spec, "
                                     "llama-server-ngram (the llama ones need `make peers`); "
                                     "keys: k, temperature, top-k, top-p, seed, ... (see bench/methods.py)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target: bundled name, HF folder or .gguf file."),
    draft: str = typer.Option(registry.DEFAULT_DRAFT, help="Draft model for spec, hf-assisted and llama-server-spec."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, help="0 = greedy; for every method that does not set its own."),
    seed: int = typer.Option(0, help="Seed of every sampled run (unless a method sets its own)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat",
                                        help="Apply the chat template (default: if the model has one)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    threads: Optional[int] = typer.Option(None, "--threads",
                                          help="torch threads, and the llama.cpp peers' (default: torch's)."),
    gguf_weights: str = GGUF_WEIGHTS_OPTION,
    repeats: int = typer.Option(1, "--repeats", help="Run each prompt and method N times, round robin, and keep the "
                                "run of median time (for machines whose speed drifts)."),
    context: Optional[int] = CONTEXT_OPTION,
    out: Path = typer.Option(Path("bench_out"), "--out", help="Folder for results.jsonl, summary.json, report.md."),
) -> None:
    """Run methods side by side on the same prompts, weights and budget; resumable; writes OUT/."""
    from specdraft.bench import BenchConfig, ExactnessError, run_bench

    try:
        require("bench", "specdraft bench", "matplotlib")  # its plots: refused before the runs, not after
        config = BenchConfig(
            out=out, methods=methods, target=target, draft=draft, prompts=prompts,
            categories=[c.strip() for c in categories.split(",") if c.strip()] if categories else None,
            max_prompts=max_prompts, turns=turns, max_new_tokens=max_new_tokens, temperature=temperature,
            seed=seed, dtype=dtype, device=device, threads=threads, chat=chat, gguf_weights=gguf_weights,
            repeats=repeats, context=context,
        )
        result = run_bench(config, console=err)
    except ExactnessError as error:
        if error.result is not None:
            err.print(_bench_table(error.result.summary))
        _fail(str(error), code=1)
    except SpecdraftError as error:
        _fail(str(error))
    else:
        err.print(_bench_table(result.summary))
        err.print(f"wrote {out}/: results.jsonl, summary.json, report.md and the PNG plots", highlight=False)


@app.command()
def loadtest(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The running `specdraft serve` to load."),
    concurrency: str = typer.Option("1,2,4,8", "--concurrency", help="Comma list of concurrent clients to try."),
    methods: str = typer.Option("ar,spec", "--methods",
                                help="Comma list: ar (each request asks for plain decoding), spec (server default)."),
    prompts: Optional[list[Path]] = typer.Option(
        None, "--prompts", help="Spec-Bench JSONL (default: the shipped set); repeat to join files."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma list of categories (default: all)."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="At most N prompts per category."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Token budget of each request."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1,
                                           help="Requests per level and round (default: 2 x the concurrency, "
                                                "and at least one per prompt at the lowest)."),
    rounds: int = typer.Option(1, "--rounds", min=1,
                               help="Run the sweep N times, the methods' order flipped each round; a level's figures "
                                    "pool its rounds (methods alternate level by level either way)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDRAFT_API_KEY", help="The server's key."),
    out: Path = typer.Option(Path("loadtest_out"), "--out", help="Folder for results.jsonl, summary.json, report.md."),
    peer: Optional[str] = typer.Option(
        None, "--peer", help="llama-server: also load llama.cpp's server, plain and with its draft-model speculation "
                             "(methods llama-server, llama-server-spec), started at each level with -np = clients "
                             "(needs `make peers`)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, "--target",
                               help="With --peer: the target the peer serves (a GGUF file or bundled name; the one "
                                    "the specdraft server serves)."),
    draft: str = typer.Option(registry.DEFAULT_DRAFT, "--draft", help="With --peer: the draft of llama-server-spec."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                          help="With --peer: the peer's threads (default: every core; give the "
                                               "specdraft server's)."),
) -> None:
    """Load a live server with concurrent streaming clients: aggregate tokens/s, TTFT and inter-token latency."""
    import os

    from specdraft.bench.loadtest import parse_concurrency, parse_methods, run_loadtest
    from specdraft.bench.loadtest_peers import make_peer, peer_methods
    from specdraft.prompts import load_prompt_files, select_prompts

    try:
        require("loadtest", "specdraft loadtest", "openai", "matplotlib")
        chosen = select_prompts(load_prompt_files(prompts),
                                [c.strip() for c in categories.split(",") if c.strip()] if categories else None,
                                max_prompts)
        peer_servers = make_peer(peer, target, draft, threads or os.cpu_count() or 1)
        summary = run_loadtest(url, chosen, parse_methods(methods) + list(peer_methods(peer)),
                               parse_concurrency(concurrency), out,
                               max_tokens=max_tokens, requests=requests, api_key=api_key, rounds=rounds,
                               progress=lambda text: err.print(text, highlight=False), peer=peer_servers)
    except SpecdraftError as error:
        _fail(str(error))
    table = Table(title="specdraft loadtest")
    for column in ("method", "clients", "tok/s", "TTFT p95 ms", "ITL p95 ms", "errors"):
        table.add_column(column, justify="right")
    for method, levels in summary["methods"].items():
        for clients, f in levels.items():
            table.add_row(method, clients, f"{f['tokens_per_second'] or 0:.1f}",
                          *(f"{(f[key]['p95'] or 0) * 1000:.0f}" for key in ("ttft", "itl")), str(f["errors"]))
    err.print(table)
    for clients, ceiling in summary["batching"].items():
        err.print(f"{clients} clients: {ceiling['share']:.1%} of the {ceiling['ceiling_tokens_per_second']:.1f} tok/s "
                  f"the passes timed in this run allow (batches of {ceiling['width']})", highlight=False)
    err.print(f"wrote {out}/: results.jsonl, summary.json, report.md and the PNG plots", highlight=False)


def _bench_table(summary: dict) -> Table:
    """The overall figures per method, and the speedup per category when there are few (report.md has all)."""
    def fmt(value, spec=".2f", suffix=""):
        return "-" if value is None else f"{value:{spec}}{suffix}"

    methods = summary["methods"]
    categories = list(dict.fromkeys(c for figures in methods.values() for c in figures["categories"]))
    categories = categories if len(categories) <= 4 else []
    peers = any(f.get("own_numerics") for f in methods.values())  # then an agreement column (see bench.summary)
    table = Table(title="specdraft bench")
    table.add_column("method", overflow="fold")
    for column in ("tok/s", "speedup", "after prefill", "τ", "α", "exact", *(["agree"] if peers else []), *categories):
        table.add_column(column, justify="right", no_wrap=True)
    for label, f in methods.items():
        exact = "n/a" if f.get("own_numerics") else fmt(f["greedy_exact"], ".0%")
        table.add_row(label, fmt(f["tokens_per_second"], ".1f"), fmt(f["speedup_vs_ar"], ".2f", "×"),
                      fmt(f.get("decode_speedup_vs_ar"), ".2f", "×"), fmt(f["mean_committed_per_step"]), fmt(f["acceptance_rate"]), exact,
                      *([fmt(f.get("agreement"), ".0%")] if peers else []),
                      *(fmt(f["categories"].get(c, {}).get("speedup_vs_ar"), ".2f", "×") for c in categories))
    return table


@app.command()
def theory(
    alpha: str = typer.Option("0.5,0.6,0.7,0.8,0.9", "--alpha",
                              help="Per-token acceptance α: one value or a comma list, each in [0, 1]."),
    k: str = typer.Option("1,2,3,4,5,6,7,8", "--k", help="Draft tokens per step: a comma list, each >= 1."),
    c: float = typer.Option(0.1, "--c", help="Cost ratio: one drafted token's time / one target step's time (>= 0)."),
    slope: float = typer.Option(0.0, "--slope", help="What each extra token of a target pass costs, as a share of "
                                "a one-token pass (`specdraft costs` measures it; 0: extra tokens are free)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the speedup-versus-acceptance chart to this PNG."),
) -> None:
    """Expected τ and speedup for α, k and c (Leviathan et al.), the best k per α; the chart with --out."""
    from specdraft.analysis.render import speedup_table, tau_table
    from specdraft.analysis.theory import parse_list, theory_grid

    try:
        if out is not None:
            require("bench", "specdraft theory --out", "matplotlib")
        alphas, ks = parse_list(alpha, float, "--alpha"), parse_list(k, int, "--k")
        grid = theory_grid(alphas, ks, c, slope)
    except SpecdraftError as error:
        _fail(str(error))
    console = Console()
    console.print(tau_table(grid))
    console.print(speedup_table(grid, c, slope))
    if out is not None:
        from specdraft.analysis.charts import speedup_chart

        try:
            speedup_chart(ks, c, out, alphas, slope)
        except OSError as error:
            _fail(f"Cannot write {out}: {error.strerror or error}.")
        err.print(f"wrote {out}", highlight=False)


@app.command()
def costs(
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target: bundled name, HF folder or .gguf file."),
    draft: Optional[str] = typer.Option(registry.DEFAULT_DRAFT, help="Draft model to time ('' for none)."),
    draft_quant: str = typer.Option("auto", "--draft-quant",
                                    help="Draft weights: int4 (CPU kernel), none, or auto (int4 on CPU)."),
    widths: str = typer.Option(",".join(map(str, COST_WIDTHS)), "--widths",
                               help="Target pass widths to time: a comma list with 1."),
    context: int = typer.Option(COST_CONTEXT, "--context", help="Cached tokens before each timed pass."),
    repeats: int = typer.Option(COST_REPEATS, "--repeats", help="Timed passes per width (the median is kept)."),
    alpha: str = typer.Option("0.5,0.6,0.7,0.8,0.9", "--alpha", help="Per-token acceptance α to predict for."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's)."),
    gguf_weights: str = GGUF_WEIGHTS_OPTION,
    out: Optional[Path] = typer.Option(None, "--out", help="Write the measurements and predictions to this JSON file."),
) -> None:
    """Time this machine: the target's pass by width, the draft per token, memory rate; expected speedup by α."""
    import torch

    from specdraft.analysis.costs import measure_costs, predict
    from specdraft.analysis.render import pass_cost_table, prediction_table
    from specdraft.analysis.theory import parse_list
    from specdraft.kernels.prebuild import build_all, in_use, in_use_text
    from specdraft.models.loading import draft_requantized, load_model, prepare_draft

    if threads:
        torch.set_num_threads(threads)
    try:
        alphas, pass_widths = parse_list(alpha, float, "--alpha"), parse_list(widths, int, "--widths")
        build_all()  # no compile inside a timed pass
        draft_lm = (prepare_draft(load_model(draft, dtype=dtype, device=device, gguf_weights=gguf_weights,
                                             requantized=draft_requantized(draft_quant, device)), draft_quant)
                    if draft else None)
        target_lm = load_model(target, dtype=dtype, device=device, gguf_weights=gguf_weights)
        report = predict(measure_costs(target_lm, draft_lm, pass_widths, context, repeats), alphas)
        running = in_use()  # the kernels that ran the passes
        if out is not None:
            out.write_text(json.dumps({**report.to_dict(), "kernels": running}, indent=2) + "\n")
    except SpecdraftError as error:
        _fail(str(error))
    except OSError as error:
        _fail(f"Cannot write {out}: {error.strerror or error}.")
    console = Console()
    console.print(in_use_text(running), highlight=False, soft_wrap=True)
    console.print(pass_cost_table(report.costs))
    console.print(prediction_table(report))
    if out is not None:
        err.print(f"wrote {out}", highlight=False)


@app.command()
def diagnose(
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target: bundled name, HF folder or .gguf file."),
    draft: str = typer.Option(registry.DEFAULT_DRAFT, help="Draft model to compare with the target, or early-exit:L "
                                                           "(the target's first L layers)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Spec-Bench JSONL (default: the shipped set)."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma list of categories (default: all)."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts",
                                              help="At most N prompts per category, in file order."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, help="0: predicted α = top-1 agreement, Σmin(p,q) and TV at temperature "
                                                "1; > 0: everything at this temperature, α = mean Σmin(p,q)."),
    tree_budget: int = typer.Option(0, "--tree-budget", help="Draft tree nodes per step (0 = a chain); with --k "
                                    "auto the cost model picks up to this many, with a whole k the tree is at most k deep."),
    tree_branch: int = typer.Option(DEFAULT_TREE_BRANCH, "--tree-branch", help="Children per tree node (with --tree-budget)."),
    draft_quant: str = typer.Option("auto", "--draft-quant",
                                    help="Draft weights: int4 (CPU kernel), none, or auto (int4 on CPU)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: torch's)."),
    measure: bool = typer.Option(True, "--measure/--no-measure",
                                 help="Also run speculative decoding on each prompt for the measured α."),
    k: int = typer.Option(DIAGNOSE_K, "--k", help="Draft tokens per step of the measured run."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for diagnose.json and agreement.png."),
) -> None:
    """Teacher-force the target's greedy output through both models: per-position fit, predicted vs measured α."""
    from specdraft.analysis.diagnose import DiagnoseConfig, run_diagnose, write_outputs
    from specdraft.analysis.render import agreement_text, diagnose_table, prompt_line

    def show(diagnosis) -> None:
        err.print(prompt_line(diagnosis), highlight=False)
        err.print(agreement_text(diagnosis.output.pieces, diagnosis.metrics.agreement), highlight=False)

    try:
        if out is not None:
            require("bench", "specdraft diagnose --out", "matplotlib")  # its chart: refused before the runs
        config = DiagnoseConfig(
            target=target, draft=draft, prompts=prompts,
            categories=[c.strip() for c in categories.split(",") if c.strip()] if categories else None,
            max_prompts=max_prompts, max_new_tokens=max_new_tokens, temperature=temperature, draft_quant=draft_quant,
            dtype=dtype, threads=threads, measure=measure, k=k,
        )
        result = run_diagnose(config, on_prompt=show)
        written = write_outputs(result, out) if out is not None else []
    except SpecdraftError as error:
        _fail(str(error))
    except OSError as error:
        _fail(f"Cannot write to {out}: {error.strerror or error}.")
    err.print(diagnose_table(result))
    err.print("[green]draft's top-1 agrees[/] [red]draft's top-1 differs[/]", highlight=False)
    if written:
        err.print(f"wrote {', '.join(str(path) for path in written)}", highlight=False)


from specdraft.surfaces.train_cli import train_app  # noqa: E402  (after the commands above, for --help order)

app.add_typer(train_app, name="train")

from specdraft.surfaces.check_cli import SHARED_OPTIONS as CHECK_SHARED_OPTIONS, check  # noqa: E402
from specdraft.surfaces.model_setup import flag_names, with_drafter_flags, with_options_of  # noqa: E402
from specdraft.surfaces.serve_cli import with_generate_options  # noqa: E402

with_drafter_flags(generate, after="k")
app.command("serve")(with_generate_options(generate))
app.command("check")(with_options_of(check, generate, [*CHECK_SHARED_OPTIONS, *flag_names()]))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
