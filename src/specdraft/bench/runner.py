"""Run every method on every prompt, interleaved, append each result as it lands, then summarise.

```
check each method can run (a peer's optional package, a GGUF target) before loading anything
build the native kernels this CPU runs (`kernels.prebuild`: no compile inside a timed generation)
load the target (and the draft, when a method needs it) once
skip (prompt, method) pairs OUT/results.jsonl already holds under the same settings
warm up each method that still has work (a short generation, not recorded)
for prompt in prompts (and, with --turns 2, each multi-turn question's second turn right after its first):
    for repeat in 1 .. --repeats:
        for method in methods:             # methods interleaved per prompt: drift cancels
            run
    per method: keep the run of median time, append its record to OUT/results.jsonl, flush
judge greedy divergences from ar with the near-tie rule (needs the target)
write OUT/summary.json, the PNG plots and OUT/report.md; raise ExactnessError if a greedy output differs
```

Methods with their own numerics (`MethodInfo.own_numerics`: the `llama-cpp` and `llama-server` peers) are
reported for agreement with `ar`, never as exactness mismatches (see `bench.summary`). What the peers started (the
llama-server processes) is stopped when the run ends, however it ends (`Models.close_peers`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Sequence

import torch
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from specdraft.analysis.costs import DEFAULT_CONTEXT, DEFAULT_WIDTHS, measure_costs
from specdraft.bench.llama_cpp_build import kept
from specdraft.bench.methods import MethodSpec, parse_methods
from specdraft.bench.runs import Models, RunOutput
from specdraft.bench.plots import write_plots
from specdraft.prompts import Prompt, default_prompts_path, load_prompt_files, select_prompts
from specdraft.bench.summary import (ExactnessError, Key, comparable, find_mismatches, is_greedy, render_report,
                                     summarize)
from specdraft.constraints import Constraint
from specdraft.errors import SpecdraftError
from specdraft.exactness import compare_greedy
from specdraft.kernels.prebuild import build_all, in_use as kernels_in_use
from specdraft.models import registry
from specdraft.models.causal_lm import CausalLM
from specdraft.models.loading import check_compatible, draft_requantized, load_model
from specdraft.text import encode_messages, encode_prompt

RESULTS, SUMMARY, REPORT = "results.jsonl", "summary.json", "report.md"


@dataclass
class BenchConfig:
    """Everything one `specdraft bench` run is given (the CLI options, parsed)."""

    out: Path
    methods: Sequence[MethodSpec] | str = "ar,spec"
    target: str = registry.DEFAULT_TARGET
    draft: str = registry.DEFAULT_DRAFT
    prompts: Path | Sequence[Path] | None = None  # None: the shipped prompt set; several files are joined
    categories: Sequence[str] | None = None
    max_prompts: int | None = None  # per category, in file order
    turns: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "auto"
    threads: int | None = None  # None: torch's default
    chat: bool | None = None  # None: the chat template when the tokenizer has one
    warmup_tokens: int = 8
    gguf_weights: str = "auto"  # see models.loading.load_model
    repeats: int = 1  # runs of each prompt and method, round robin; the one of median time is kept
    context: int | None = None  # what every model holds (`load_model(max_context=)`; None: each its own)


@dataclass
class BenchResult:
    """What a run wrote: the output folder, the summary (as in summary.json), the records and any mismatches."""

    out: Path
    summary: dict
    records: list[dict]
    mismatches: list[Key] = field(default_factory=list)


# ----- the machine and the settings --------------------------------------------------------------------
COSTS_REPEATS = 5  # timed passes per width for the summary's `costs` (a few seconds on the bundled pair)

def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, llama_cpp: bool = False, llama_server: bool = False) -> dict:
    """What the numbers were measured on: the CPU, the libraries, our native kernels in use (`kernels`: their
    level and tile kernel), where the llama-cpp peer ran (`llama_cpp`) the CPU features llama.cpp reports and the
    build `make peers` kept, and where a llama-server peer ran (`llama_server`) its binary and build."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kernels": kernels_in_use(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    for package in ("transformers", "llama_cpp"):  # the libraries the methods ran on (llama_cpp: if used)
        version = getattr(sys.modules.get(package), "__version__", None)
        if version is not None:
            info[package] = version
    if llama_cpp:
        from specdraft.bench.llama_cpp_peer import system_info

        info["llama_cpp_system_info"] = system_info()
        info["llama_cpp_build"] = kept().get("llama_cpp_python", {}).get("build")
    if llama_server:
        from specdraft.bench.llama_server import build_info

        info["llama_server"] = build_info()
    return info


def machine_costs(models: Models) -> dict | None:
    """What this machine's passes cost (`specdraft costs`: the target by width, the run's draft as `spec` runs
    it), timed after the prompts: a speedup depends on it, and machines differ (see README, Benchmark).
    None for a model whose context cannot hold the widest pass after a few cached tokens."""
    context = min(DEFAULT_CONTEXT, models.target.max_context - max(DEFAULT_WIDTHS))
    if context < 1:
        return None
    draft = models.draft_as("auto", "auto") if models.draft is not None else None
    return measure_costs(models.target, draft, context=context, repeats=COSTS_REPEATS).to_dict()


def run_settings(config: BenchConfig, models: Models, prompts_paths: Sequence[Path], methods: Sequence[MethodSpec]) -> dict:
    """The settings of a run as summary.json reports them (dtype, device and threads as resolved)."""
    return {
        "target": config.target, "draft": config.draft if models.draft is not None else None,
        "dtype": str(models.target.dtype).removeprefix("torch."), "device": str(models.target.device),
        "max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "seed": config.seed,
        "turns": config.turns, "threads": torch.get_num_threads(), "chat": config.chat,
        "prompts": ", ".join(str(p) for p in prompts_paths), "categories": list(config.categories or []),
        "max_prompts": config.max_prompts, "methods": [spec.label for spec in methods],
        "warmup_tokens": config.warmup_tokens, "repeats": config.repeats, "context": config.context,
        "held_context": {"target": models.target.max_context,
                         **({"draft": models.draft.max_context} if models.draft is not None else {}),
                         **{name: lm.max_context for name, lm in models.other_drafts.items()}},
    }


def settings_id(settings: dict, needs_draft: bool) -> str:
    """A short hash of the settings that shape a method's records (the draft only where it drafts)."""
    keys = ["target", "dtype", "device", "max_new_tokens", "temperature", "seed", "turns", "threads", "chat"]
    shaping = {key: settings[key] for key in keys} | ({"draft": settings["draft"]} if needs_draft else {})
    if settings.get("repeats", 1) != 1:  # (single runs keep the ids they had before repeats existed)
        shaping["repeats"] = settings["repeats"]
    if settings.get("context") is not None:  # (so do runs at the models' own contexts)
        shaping["context"] = settings["context"]
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


# ----- results.jsonl ----------------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict]:
    """The records in `path` (none if it is missing); a line cut short by an interruption is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "question_id" in record and "method" in record:
            records.append(record)
    return records


def append_record(path: Path, record: dict) -> None:
    """Append one record as a line and flush it (after mending a line an interruption left unfinished)."""
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record) + "\n").encode("utf-8"))
        f.flush()


# ----- the steps of a run --------------------------------------------------------------------------------
def _load_models(config: BenchConfig, methods: Sequence[MethodSpec]) -> Models:
    """The target and the drafts the methods need, each held to `config.context` (the drafts to as much of it as
    their positions allow: `surfaces.model_setup.load_models`)."""
    target = load_model(config.target, dtype=config.dtype, device=None if config.device == "auto" else config.device,
                        gguf_weights=config.gguf_weights, max_context=config.context)
    draft = None
    if any(spec.needs_draft for spec in methods):
        requantized = any(spec.needs_draft and draft_requantized(spec.draft_quant, target.device) for spec in methods)
        draft = load_model(config.draft, dtype=config.dtype, device=target.device, gguf_weights=config.gguf_weights,
                           requantized=requantized, max_context=config.context, clip_context=True)
        check_compatible(target, draft)
    others = {}
    for name in sorted({spec.other_draft for spec in methods} - {""}):  # loaded now: a bad path fails before any run
        others[name] = load_model(name, dtype=config.dtype, device=target.device, gguf_weights=config.gguf_weights,
                                  max_context=config.context, clip_context=True)
        check_compatible(target, others[name])
    return Models(target, draft, others, target_spec=config.target, draft_spec=config.draft)


SECOND_TURN = ":turn2"  # what a question's id gets for its second turn (records, report)


def second_turn(prompt: Prompt) -> Prompt:
    """The second turn of a multi-turn question, as a question of its own (id `<id>:turn2`, same category)."""
    return Prompt(f"{prompt.question_id}{SECOND_TURN}", prompt.category, prompt.turns)


def _check_room(question_id: Hashable, ids: list[int], models: Models, config: BenchConfig) -> list[int]:
    """`ids`, if they leave room for --max-new-tokens in the target (a draft keeps its reads within its own
    positions: `ModelDrafter`); else a clear error."""
    target = models.target
    if len(ids) + config.max_new_tokens > target.max_context:
        raise SpecdraftError(
            f"Question {question_id!r} has {len(ids)} prompt tokens; with --max-new-tokens "
            f"{config.max_new_tokens} that passes {target.name}'s context of {target.max_context}. "
            "Lower --max-new-tokens or leave that prompt out."
        )
    return ids


def _encode(prompts: Sequence[Prompt], models: Models, config: BenchConfig) -> dict[Hashable, list[int]]:
    """Token ids of each prompt's first turn; each must leave room for --max-new-tokens in the target."""
    return {prompt.question_id: _check_room(prompt.question_id,
                                            encode_prompt(models.target.tokenizer, prompt.turns[0], chat=config.chat),
                                            models, config)
            for prompt in prompts}


def _encode_second_turn(prompt: Prompt, answer_ids: list[int], models: Models, config: BenchConfig) -> list[int]:
    """The conversation (first turn, `answer_ids` as the assistant's reply, second turn) through the chat template.

    Every method continues from the same reply (`ar`'s, else the first method's), so the second
    turns time the same prompt everywhere; exact methods would have written that reply anyway."""
    tokenizer = models.target.tokenizer
    reply = tokenizer.decode(answer_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": prompt.turns[0]}, {"role": "assistant", "content": reply},
                {"role": "user", "content": prompt.turns[1]}]
    return _check_room(prompt.question_id, encode_messages(tokenizer, messages), models, config)


def prompt_constraint(prompt: Prompt, spec: MethodSpec) -> Constraint | None:
    """What `spec`'s answer to `prompt` must follow: the prompt's schema, where it has one and the method follows it."""
    return Constraint.json_schema(prompt.schema) if prompt.schema and spec.follows_schema else None


def _check_schemas(prompts: Sequence[Prompt], methods: Sequence[MethodSpec]) -> None:
    """Prompts with a schema need methods that follow one, and schemas llguidance can follow: clear errors first."""
    with_schema = [p for p in prompts if p.schema]
    if not with_schema:
        return
    refusing = [s.label for s in methods if not s.info.constrains]
    if refusing:
        raise SpecdraftError(f"Method {refusing[0]!r} cannot answer under a JSON schema, and {len(with_schema)} of the "
                             "prompts have one; compare ar and spec on them (spec:schema=0 runs without it).")
    for prompt in with_schema:
        try:
            Constraint.json_schema(prompt.schema).check()
        except SpecdraftError as error:
            raise SpecdraftError(f"Question {prompt.question_id!r}: {error}") from None


def _record(prompt: Prompt, spec: MethodSpec, ids: list[int], outputs: Sequence[RunOutput], temperature: float,
            sid: str, constraint: Constraint | None = None, answer: str = "") -> dict:
    """The record of the run of median time among `outputs` (one per repeat; the lower median of an even count); with
    repeats it also lists every run's time and whether they all gave the same tokens (they should: a seed fixes
    sampling, and greedy has no choice)."""
    output = sorted(outputs, key=lambda o: o.wall_seconds)[(len(outputs) - 1) // 2]
    repeated = {} if len(outputs) == 1 else {
        "repeat_seconds": [o.wall_seconds for o in outputs],
        "repeats_agree": all(o.token_ids == outputs[0].token_ids for o in outputs),
    }
    constrained = {} if constraint is None else {
        "constrained": True, "valid": constraint.validates(answer), "forced_tokens": output.forced_tokens,
        "mask_seconds": output.mask_seconds,
    }
    return {
        "question_id": prompt.question_id,
        "category": prompt.category,
        "method": spec.label,
        "new_tokens": len(output.token_ids),
        "wall_seconds": output.wall_seconds,
        "steps": output.steps,
        "drafted": output.drafted,
        "accepted": output.accepted,
        "accepted_at": output.accepted_at,
        "drafted_at": output.drafted_at,
        "draft_seconds": output.draft_seconds,
        "verify_seconds": output.verify_seconds,
        "prefill_seconds": output.prefill_seconds,
        "k": output.k,
        "k_per_step": output.k_per_step,
        "by_source": output.by_source,
        "token_ids": output.token_ids,
        "prompt_tokens": len(ids),
        "temperature": temperature,
        "settings_id": sid,
    } | repeated | constrained


def _constraint_argument(constraint: Constraint | None) -> dict:
    """The keyword a method's run takes a constraint by (none without one: every method runs unconstrained)."""
    return {} if constraint is None else {"constraint": constraint}


def _progress(console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"),
        console=console or Console(stderr=True, quiet=True), disable=console is None,
    )


def judge_divergences(records: Sequence[dict], reference: str | None, target: CausalLM,
                      prompt_ids: dict[Hashable, list[int]]) -> tuple[dict[Key, bool], list[dict]]:
    """For each greedy run whose tokens differ from the reference's: is the first divergence a near-tie?

    Returns the verdicts `{(question_id, method): near_tie}` and their details for summary.json.
    A run that is a strict prefix of the other (different length, no differing token) is no near-tie.
    """
    verdicts, details = {}, []
    refs = {r["question_id"]: r for r in records if r["method"] == reference and is_greedy(r)}
    for record in records:
        ref = refs.get(record["question_id"])
        if (ref is None or record is ref or not is_greedy(record) or record["token_ids"] == ref["token_ids"]
                or not comparable(record, ref)):
            continue
        comparison = compare_greedy(target, prompt_ids[record["question_id"]], ref["token_ids"], record["token_ids"])
        near_tie = not comparison.equal and comparison.near_tie
        verdicts[(record["question_id"], record["method"])] = near_tie
        details.append({"question_id": record["question_id"], "method": record["method"],
                        "diverged_at": comparison.diverged_at, "top2_gap": comparison.top2_gap,
                        "near_tie": near_tie})
    return verdicts, details


def run_bench(config: BenchConfig, console: Console | None = None) -> BenchResult:
    """Run the benchmark into `config.out` (resuming), write the summary, plots and report, and return them.

    `console` (e.g. stderr) shows a progress bar; None runs quietly. Raises ExactnessError,
    after every file is written, when a greedy method's output differs from `ar` beyond a near-tie.
    """
    methods = parse_methods(config.methods) if isinstance(config.methods, str) else list(config.methods)
    if config.turns not in (1, 2):
        raise SpecdraftError(f"--turns must be 1 (first turns) or 2 (continue multi-turn questions), got {config.turns}.")
    if config.turns == 2 and config.chat is False:
        raise SpecdraftError("--turns 2 continues a conversation through the chat template; drop --no-chat.")
    if config.max_new_tokens < 1:
        raise SpecdraftError(f"--max-new-tokens must be >= 1, got {config.max_new_tokens}.")
    if config.threads is not None and config.threads < 1:
        raise SpecdraftError(f"--threads must be >= 1, got {config.threads}.")
    if config.repeats < 1:
        raise SpecdraftError(f"--repeats must be >= 1, got {config.repeats}.")
    params = {spec.label: spec.params(config.max_new_tokens, config.temperature, config.seed) for spec in methods}
    paths = [config.prompts] if isinstance(config.prompts, (str, Path)) else list(config.prompts or [])
    prompts_paths = [Path(p) for p in paths] or [default_prompts_path()]
    prompts = select_prompts(load_prompt_files(paths), config.categories, config.max_prompts)
    _check_schemas(prompts, methods)
    for info in {spec.name: spec.info for spec in methods}.values():
        if info.check is not None:
            info.check(config.target)
    own_numerics = [spec.label for spec in methods if spec.info.own_numerics]
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    threads_before = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    models = None
    try:
        build_all()  # the native kernels, before anything is loaded or timed (a no-op once they are cached)
        models = _load_models(config, methods)
        settings = run_settings(config, models, prompts_paths, methods)
        sids = {spec.label: settings_id(settings, spec.needs_draft) for spec in methods}
        prompt_ids = _encode(prompts, models, config)

        results_path = out / RESULTS
        done = {(r["question_id"], r["method"]): r for r in read_records(results_path)
                if r["method"] in sids and r.get("settings_id") == sids[r["method"]]}
        # each question's first turn, then (--turns 2) its second, every method on each
        seconds = {second_turn(p).question_id: p for p in prompts if config.turns == 2 and len(p.turns) > 1}
        asked = [turn for p in prompts for turn in ([p, second_turn(p)] if second_turn(p).question_id in seconds else [p])]
        todo = [(p, s) for p in asked for s in methods if (p.question_id, s.label) not in done]
        reference = next((s.label for s in methods if s.name == "ar"), None)

        def ids_of(turn: Prompt) -> list[int]:  # a second turn's: once its first turn's reply is there
            if turn.question_id not in prompt_ids:
                reply = done[(seconds[turn.question_id].question_id, reference or methods[0].label)]["token_ids"]
                prompt_ids[turn.question_id] = _encode_second_turn(turn, reply, models, config)
            return prompt_ids[turn.question_id]

        if todo:  # one short, unrecorded generation per method that still has work
            first_ids = prompt_ids[prompts[0].question_id]
            warmup = max(1, min(config.warmup_tokens, config.max_new_tokens))
            for spec in {s.label: s for _, s in todo}.values():  # with a constraint: its tokenizer is built here
                spec.info.run(models, first_ids, dataclasses.replace(params[spec.label], max_new_tokens=warmup),
                              **_constraint_argument(prompt_constraint(prompts[0], spec)))

        with _progress(console) as progress:
            task = progress.add_task("", total=len(todo) * config.repeats)
            for prompt in dict.fromkeys(p for p, _ in todo):
                specs = [s for p, s in todo if p == prompt]
                ids = ids_of(prompt)
                constraints = {s.label: prompt_constraint(prompt, s) for s in specs}
                outputs: dict[str, list[RunOutput]] = {s.label: [] for s in specs}
                for repeat in range(config.repeats):
                    for spec in specs:
                        progress.update(task, description=f"question {prompt.question_id} / {spec.label}"
                                                          + (f" ({repeat + 1}/{config.repeats})" if config.repeats > 1 else ""))
                        outputs[spec.label].append(spec.info.run(models, ids, params[spec.label],
                                                                 **_constraint_argument(constraints[spec.label])))
                        progress.advance(task)
                for spec in specs:
                    constraint = constraints[spec.label]
                    answer = "" if constraint is None else models.target.tokenizer.decode(
                        outputs[spec.label][0].token_ids, skip_special_tokens=True)
                    record = _record(prompt, spec, ids, outputs[spec.label], params[spec.label].sampling.temperature,
                                     sids[spec.label], constraint, answer)
                    append_record(results_path, record)
                    done[(prompt.question_id, spec.label)] = record

        for prompt in asked:  # (a resumed run: second turns whose ids were not needed above)
            ids_of(prompt)
        records = [done[(p.question_id, s.label)] for p in asked for s in methods]
        near_ties, divergences = judge_divergences(records, reference, models.target, prompt_ids)
        summary = {
            "machine": machine_info(models.target.device, llama_cpp=any(s.name == "llama-cpp" for s in methods),
                                    llama_server=any(s.name.startswith("llama-server") for s in methods)),
            "costs": machine_costs(models),
            "settings": settings,
            "methods": summarize(records, reference, near_ties, [s.label for s in methods], own_numerics),
            "divergences": divergences,
            "repeats_disagree": [f"{r['question_id']} / {r['method']}" for r in records if r.get("repeats_agree") is False],
        }
        (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        plots = write_plots(summary, records, out)
        (out / REPORT).write_text(render_report(summary, plots), encoding="utf-8")
        result = BenchResult(out, summary, records, find_mismatches(records, reference, near_ties, own_numerics))
    finally:
        if models is not None:
            models.close_peers()  # the llama-server processes end with the run, however it ends
        torch.set_num_threads(threads_before)
    if result.mismatches:
        raise ExactnessError(result.mismatches, result)
    return result
