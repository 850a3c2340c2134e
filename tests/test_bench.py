"""`specdraft bench`: summary arithmetic, method strings, prompts, resumption, the exactness check, the CLI."""

import dataclasses
import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from specdraft.bench import (METHODS, BenchConfig, ExactnessError, check_exactness, find_mismatches, load_prompts,
                             parse_method, parse_methods, render_report, run_bench, select_prompts, summarize)
from specdraft.bench.runs import Models
from specdraft.bench.runner import append_record, read_records, settings_id
from specdraft.errors import SpecdraftError
from specdraft.models.loading import load_model
from specdraft.text import encode_messages
from specdraft.surfaces.cli import app

# ----- summary arithmetic on synthetic records ---------------------------------------------------------


def rec(qid, category, method, new, wall, tokens, steps=None, drafted=None, accepted=None, temperature=0.0):
    return {"question_id": qid, "category": category, "method": method, "new_tokens": new, "wall_seconds": wall,
            "steps": steps, "drafted": drafted, "accepted": accepted, "token_ids": tokens, "temperature": temperature}


SAME, OTHER = list(range(10)), [0, 1, 2, 99, 4, 5]
RECORDS = [
    rec(1, "code", "ar", 10, 1.0, SAME, steps=10, drafted=0, accepted=0),
    rec(1, "code", "spec", 10, 0.5, SAME, steps=4, drafted=12, accepted=6),
    rec(1, "code", "hf-ar", 10, 1.25, SAME),
    rec(1, "code", "spec:temperature=1", 10, 0.4, OTHER, steps=2, drafted=8, accepted=8, temperature=1.0),
    rec(2, "prose", "ar", 20, 4.0, SAME, steps=20, drafted=0, accepted=0),
    rec(2, "prose", "spec", 20, 1.5, OTHER, steps=5, drafted=16, accepted=15),  # diverges at a near-tie
    rec(2, "prose", "hf-ar", 18, 3.75, OTHER),  # diverges, not at a near-tie
    rec(2, "prose", "spec:temperature=1", 20, 1.6, SAME, steps=4, drafted=16, accepted=16, temperature=1.0),
]
NEAR_TIES = {(2, "spec"): True, (2, "hf-ar"): False}


def test_summary_arithmetic_by_hand():
    s = summarize(RECORDS, "ar", NEAR_TIES)
    assert list(s) == ["ar", "spec", "hf-ar", "spec:temperature=1"]
    approx = pytest.approx
    # ar: 30 tokens / 5 s; nothing drafted; 30 tokens / 30 steps
    assert s["ar"]["tokens_per_second"] == approx(6.0)
    assert s["ar"]["speedup_vs_ar"] == approx(1.0)
    assert s["ar"]["acceptance_rate"] is None
    assert s["ar"]["mean_committed_per_step"] == approx(1.0)
    assert s["ar"]["greedy_exact"] == approx(1.0)
    # spec: 30 / 2.0 s = 15 tok/s = 2.5x; α = 21 / 28; τ = 30 / 9; prompt 2 differs only at a near-tie
    assert s["spec"]["tokens_per_second"] == approx(15.0)
    assert s["spec"]["speedup_vs_ar"] == approx(2.5)
    assert s["spec"]["acceptance_rate"] == approx(0.75)
    assert s["spec"]["mean_committed_per_step"] == approx(30 / 9)
    assert s["spec"]["greedy_exact"] == approx(1.0)
    code, prose = s["spec"]["categories"]["code"], s["spec"]["categories"]["prose"]
    assert (code["tokens_per_second"], code["speedup_vs_ar"], code["acceptance_rate"],
            code["mean_committed_per_step"]) == (approx(20.0), approx(2.0), approx(0.5), approx(2.5))
    assert (prose["tokens_per_second"], prose["speedup_vs_ar"], prose["acceptance_rate"],
            prose["mean_committed_per_step"]) == (approx(40 / 3), approx(8 / 3), approx(15 / 16), approx(4.0))
    # hf-ar: 28 / 5 s; no counts; one of two prompts equal
    hf = s["hf-ar"]
    assert (hf["tokens_per_second"], hf["speedup_vs_ar"]) == (approx(5.6), approx(28 / 30))
    assert hf["acceptance_rate"] is None and hf["mean_committed_per_step"] is None
    assert hf["greedy_exact"] == approx(0.5)
    assert hf["categories"]["code"]["greedy_exact"] == 1.0 and hf["categories"]["prose"]["greedy_exact"] == 0.0
    assert hf["categories"]["prose"]["speedup_vs_ar"] == approx(4.8 / 5.0)
    # a sampled method has no greedy verdict
    assert s["spec:temperature=1"]["greedy_exact"] is None
    assert s["spec:temperature=1"]["acceptance_rate"] == approx(24 / 24)


def test_summary_without_ar_has_no_speedup_or_exactness():
    s = summarize([r for r in RECORDS if r["method"] != "ar"], "ar", NEAR_TIES)
    assert all(m["speedup_vs_ar"] is None and m["greedy_exact"] is None for m in s.values())
    assert s["spec"]["tokens_per_second"] == pytest.approx(15.0)
    assert summarize(RECORDS, None)["spec"]["speedup_vs_ar"] is None


def test_speedup_after_the_prompt_pass():
    """A long prompt's prefill is shared work: the speedup after it is shown beside the whole answer's."""
    timed = [dict(rec(1, "rag", "ar", 20, 4.0, SAME), prefill_seconds=2.0),
             dict(rec(1, "rag", "spec", 20, 3.0, SAME), prefill_seconds=2.0),
             rec(1, "rag", "hf-ar", 20, 5.0, SAME)]  # a peer: its prompt pass is not timed
    s = summarize(timed, "ar")
    assert s["spec"]["speedup_vs_ar"] == pytest.approx(4 / 3)
    assert s["spec"]["decode_speedup_vs_ar"] == pytest.approx(2.0)  # 20 tokens in 1 s against 2 s
    assert (s["ar"]["prefill_share"], s["spec"]["prefill_share"]) == (pytest.approx(0.5), pytest.approx(2 / 3))
    assert s["hf-ar"]["decode_speedup_vs_ar"] is None and s["hf-ar"]["prefill_share"] is None
    assert s["spec"]["categories"]["rag"]["decode_speedup_vs_ar"] == pytest.approx(2.0)
    report = render_report({"methods": s})
    assert "after prefill" in report and "| `spec` | rag | 1.33× | 2.00× | 67% |" in report


def test_exactness_check_catches_a_planted_mismatch():
    assert find_mismatches(RECORDS, "ar", NEAR_TIES) == [(2, "hf-ar")]
    assert find_mismatches(RECORDS, "ar", {}) == [(2, "spec"), (2, "hf-ar")]  # no near-tie verdict: a mismatch
    with pytest.raises(ExactnessError) as caught:
        check_exactness(RECORDS, "ar", NEAR_TIES)
    assert caught.value.mismatches == [(2, "hf-ar")]
    assert "question 2 / hf-ar" in str(caught.value)
    check_exactness([r for r in RECORDS if r["method"] != "hf-ar"], "ar", NEAR_TIES)  # nothing to report


def test_report_has_every_method_and_category():
    report = render_report({"methods": summarize(RECORDS, "ar", NEAR_TIES), "settings": {"max_new_tokens": 128},
                            "machine": {"cores": 2}})
    for text in ("`spec`", "`hf-ar`", "code", "prose", "2.50×", "max_new_tokens", "cores"):
        assert text in report
    assert "costs" not in report  # not measured: no section


def test_report_shows_the_machines_costs():
    costs = {"context": 300, "pass_seconds": {"1": 0.0284, "2": 0.0343}, "draft_seconds": 0.0097, "draft_ratio": 0.34,
             "extra_token_seconds": 0.0074, "stream_gb_per_s": 51.0, "target_bytes": 1.05e9, "weights_gb_per_s": 37.1}
    report = render_report({"methods": summarize(RECORDS, "ar", NEAR_TIES), "costs": costs})
    assert "| ms | 28.4 | 34.3 | 9.7 (c = 0.34) |" in report
    assert "each further token adds 7.4 ms" in report and "51.0 GB/s" in report and "moved" not in report
    moved = render_report({"methods": {}, "costs": {**costs, "stream_drift": 0.7, "stream_after_gb_per_s": 30.0}})
    assert "The memory rate moved 70%" in moved


# ----- method strings ------------------------------------------------------------------------------------


def test_method_strings_parse():
    spec = parse_method("spec:k=8;temperature=0.7;top-p=0.9")
    assert (spec.label, spec.name, spec.options) == ("spec:k=8;temperature=0.7;top-p=0.9", "spec",
                                                      {"k": 8, "temperature": 0.7, "top-p": 0.9})
    sampling = parse_method("hf-ar:top-k=5").sampling(temperature=0.5, seed=3)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed) == (0.5, 5, 1.0, 3)
    assert parse_method("ar:seed=9").sampling(0.0, 1).seed == 9
    assert [m.label for m in parse_methods("ar, spec:k=2,hf-assisted,hf-prompt-lookup")] == \
        ["ar", "spec:k=2", "hf-assisted", "hf-prompt-lookup"]


@pytest.mark.parametrize("text, message", [
    ("nope", "Unknown method 'nope'"),
    ("ar:k=2", "Unknown option 'k' for method 'ar'"),
    ("spec:depth=2", "Unknown option 'depth' for method 'spec'"),
    ("spec:k=two", "k must be auto or a whole number"),
    ("spec:k", "key=value"),
    ("spec:k=2;k=3", "given twice"),
    ("ar,ar", "listed twice"),
    (" , ", "No methods given"),
])
def test_bad_method_strings_are_clear_errors(text, message):
    with pytest.raises(SpecdraftError, match=message.replace("(", r"\(")):
        parse_methods(text)


def test_bad_option_values_are_clear_errors():
    with pytest.raises(SpecdraftError, match="k must be >= 1"):
        parse_method("spec:k=0").params(16)
    with pytest.raises(SpecdraftError, match="temperature must be >= 0"):
        parse_method("spec:temperature=-1").params(16)


# ----- prompts -----------------------------------------------------------------------------------------------


def test_shipped_prompts_and_selection(tmp_path):
    prompts = load_prompts()
    assert len(prompts) == 12 and len({p.question_id for p in prompts}) == 12
    assert [p.category for p in prompts].count("code") == 6 and [p.category for p in prompts].count("prose") == 6
    chosen = select_prompts(prompts, ["prose"], 2)
    assert chosen == [p for p in prompts if p.category == "prose"][:2]
    assert len(select_prompts(prompts, None, 1)) == 2
    with pytest.raises(SpecdraftError, match="Unknown category 'maths'.*code, prose"):
        select_prompts(prompts, ["maths"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "a", "turns": ["x"]}\n{"question_id": 2, "category": "a"}\n')
    with pytest.raises(SpecdraftError, match="line 2: turns"):
        load_prompts(bad)


# ----- runs on the tiny models -----------------------------------------------------------------------------


@pytest.fixture()
def tiny_prompts(tmp_path):
    """Short prompts (the tiny target holds 128 positions), two per category."""
    path = tmp_path / "prompts.jsonl"
    items = [(11, "code", "def add(a, b)"), (12, "code", "for i in range"), (21, "prose", "The quick brown fox"),
             (22, "prose", "Speculative decoding drafts")]
    path.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [t]}) + "\n" for q, c, t in items))
    return path


@pytest.fixture()
def tiny_config(tiny_model_dirs, tiny_prompts, tmp_path):
    def make(**changes):
        base = BenchConfig(out=tmp_path / "out", methods="ar,spec:k=2", target=str(tiny_model_dirs["target"]),
                           draft=str(tiny_model_dirs["draft"]), prompts=tiny_prompts, max_new_tokens=12,
                           dtype="float32", threads=1, warmup_tokens=3)
        return dataclasses.replace(base, **changes)
    return make


@pytest.fixture()
def counted_runs(monkeypatch):
    """Count the measured runs and the warm-ups (3 tokens) of each method."""
    calls = []
    for name, info in list(METHODS.items()):
        def counting(models, ids, params, _run=info.run, _name=name):
            calls.append((_name, "warmup" if params.max_new_tokens == 3 else "run"))
            return _run(models, ids, params)
        monkeypatch.setitem(METHODS, name, dataclasses.replace(info, run=counting))
    return calls


def test_resumption_skips_finished_pairs(tiny_config, counted_runs):
    first = run_bench(tiny_config(max_prompts=1))  # one prompt per category
    assert sorted(counted_runs) == sorted([("ar", "warmup"), ("spec", "warmup")] + [("ar", "run"), ("spec", "run")] * 2)
    counted_runs.clear()
    second = run_bench(tiny_config())  # "interrupted" after the first prompts: only the rest runs
    assert sorted(name for name, kind in counted_runs if kind == "run") == ["ar", "ar", "spec", "spec"]
    counted_runs.clear()
    third = run_bench(tiny_config())  # all done: nothing runs, not even a warm-up
    assert counted_runs == []
    lines = (first.out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8 and len({(json.loads(x)["question_id"], json.loads(x)["method"]) for x in lines}) == 8
    assert third.records == second.records
    assert third.summary["methods"]["spec:k=2"]["greedy_exact"] == 1.0
    for record in map(json.loads, lines):  # the timings and counts land in their own fields
        assert 0 < record["prefill_seconds"] < record["wall_seconds"]
        assert len(record["k_per_step"]) == record["steps"] and isinstance(record["by_source"], dict)
        assert record["k"] == (max(record["k_per_step"]) or None)
    counted_runs.clear()
    run_bench(tiny_config(max_new_tokens=10, max_prompts=1))  # other settings: run again, not reused
    assert len([c for c in counted_runs if c[1] == "run"]) == 4


def test_repeats_run_round_robin_and_keep_the_median_run(tiny_config, counted_runs, monkeypatch):
    """--repeats 3: each prompt runs ar, spec, ar, spec, ar, spec; the record kept is the run of median time, with
    every run's time beside it; single runs keep their old settings id (and records)."""
    clock = iter([5.0, 1.0, 3.0, 2.0, 4.0, 9.0] * 10)  # per prompt: ar 5, 3, 4 -> 4; spec 1, 2, 9 -> 2
    for name in ("ar", "spec"):
        info = METHODS[name]

        def timed(models, ids, params, _run=info.run):
            output = _run(models, ids, params)
            return dataclasses.replace(output, wall_seconds=next(clock)) if params.max_new_tokens != 3 else output
        monkeypatch.setitem(METHODS, name, dataclasses.replace(info, run=timed))
    result = run_bench(tiny_config(max_prompts=1, repeats=3))
    prompts = len(result.records) // 2
    assert [n for n, kind in counted_runs if kind == "run"] == ["ar", "spec"] * 3 * prompts
    for record in result.records:
        want = {"ar": ([5.0, 3.0, 4.0], 4.0), "spec:k=2": ([1.0, 2.0, 9.0], 2.0)}[record["method"]]
        assert (record["repeat_seconds"], record["wall_seconds"]) == want and record["repeats_agree"]
    assert result.summary["settings"]["repeats"] == 3 and result.summary["repeats_disagree"] == []
    assert "ran 3 times per method" in (result.out / "report.md").read_text()
    ids = {r["settings_id"] for r in result.records}
    single = run_bench(tiny_config(max_prompts=1, out=result.out.parent / "single"))
    assert {r["settings_id"] for r in single.records}.isdisjoint(ids) and "repeat_seconds" not in single.records[0]
    with pytest.raises(SpecdraftError, match="--repeats must be >= 1"):
        run_bench(tiny_config(repeats=0))


def test_runner_exits_on_a_planted_mismatch(tiny_config, monkeypatch):
    info = METHODS["spec"]

    def wrong(models, ids, params):
        output = info.run(models, ids, params)
        if len(output.token_ids) > 3:  # (not the 3-token warm-up)
            output.token_ids[3] = (output.token_ids[3] + 1) % models.target.vocab_size  # no near-tie in float32
        return output
    monkeypatch.setitem(METHODS, "spec", dataclasses.replace(info, run=wrong))
    with pytest.raises(ExactnessError) as caught:
        run_bench(tiny_config(max_prompts=1))
    assert caught.value.mismatches == [(11, "spec:k=2"), (21, "spec:k=2")]
    summary = json.loads((caught.value.result.out / "summary.json").read_text())
    assert summary["methods"]["spec:k=2"]["greedy_exact"] == 0.0
    assert [d["diverged_at"] for d in summary["divergences"]] == [3, 3]
    assert not any(d["near_tie"] for d in summary["divergences"])


def test_an_interrupted_line_is_skipped_and_mended(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"question_id": 1, "method": "ar"}\n{"question_id": 2, "meth')  # cut short mid-write
    append_record(path, {"question_id": 3, "method": "ar"})
    assert [r["question_id"] for r in read_records(path)] == [1, 3]


def test_bench_cli_exits_1_on_a_mismatch(tiny_model_dirs, tiny_prompts, tmp_path, monkeypatch):
    info = METHODS["hf-ar"]

    def wrong(models, ids, params):
        output = info.run(models, ids, params)
        output.token_ids[-1] = (output.token_ids[-1] + 1) % models.target.vocab_size
        return output
    monkeypatch.setitem(METHODS, "hf-ar", dataclasses.replace(info, run=wrong))
    result = CliRunner().invoke(app, [
        "bench", "--target", str(tiny_model_dirs["target"]), "--prompts", str(tiny_prompts), "--methods", "ar,hf-ar",
        "--max-prompts", "1", "--categories", "code", "--max-new-tokens", "8", "--dtype", "float32",
        "--threads", "1", "--out", str(tmp_path / "o"),
    ])
    assert result.exit_code == 1, result.output
    assert "question 11 / hf-ar" in result.stderr and "hf-ar" in result.stderr
    assert (tmp_path / "o" / "report.md").is_file()


# ----- the command line ---------------------------------------------------------------------------------------


def test_bench_cli_end_to_end(tiny_model_dirs, tiny_prompts, tmp_path):
    out = tmp_path / "cli_out"
    result = CliRunner().invoke(app, [
        "bench", "--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]),
        "--prompts", str(tiny_prompts), "--methods", "ar,spec:k=2,hf-ar,hf-assisted", "--max-prompts", "1",
        "--max-new-tokens", "16", "--dtype", "float32", "--threads", "1", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 8  # 2 categories x 1 prompt x 4 methods
    for record in records:
        assert {"question_id", "category", "method", "new_tokens", "wall_seconds", "steps", "drafted", "accepted",
                "accepted_at", "token_ids", "prompt_tokens"} <= set(record)
        assert record["new_tokens"] == len(record["token_ids"]) > 0
    assert all(r["steps"] is None and r["accepted_at"] is None for r in records if r["method"].startswith("hf-"))
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"machine", "settings", "methods"}
    assert {"cpu", "cores", "torch", "threads", "python", "kernels"} <= set(summary["machine"])
    assert summary["machine"]["kernels"]["isa"] in ("torch", "avx2", "avx512", "amx")  # our kernels' level, tiles
    assert "llama_cpp_system_info" not in summary["machine"]  # only where the llama-cpp peer ran
    assert list(summary["methods"]) == ["ar", "spec:k=2", "hf-ar", "hf-assisted"]
    for figures in summary["methods"].values():
        assert figures["greedy_exact"] == 1.0 and set(figures["categories"]) == {"code", "prose"}
    costs = summary["costs"]  # the machine's pass costs, timed after the prompts (tiny models: short context)
    assert set(costs["pass_seconds"]) == {str(w) for w in range(1, 9)} and costs["draft_seconds"] > 0
    assert costs["context"] == 128 - 8  # the tiny target's 128 positions less the widest pass
    assert "| `hf-assisted` |" in (out / "report.md").read_text()
    assert "## This machine's costs" in (out / "report.md").read_text()
    assert "speedup" in result.stderr and "after prefill" in result.stderr


def test_bench_cli_holds_every_model_to_context(tiny_model_dirs, tiny_prompts, tmp_path):
    """`bench --context` holds the target and the draft to it (the machine's costs are timed within what the target
    holds), summary.json and report.md say what each held, and the records are keyed by it (a run at the models' own
    contexts does not take them); a context past the target's 128 positions is refused, naming it."""
    out = tmp_path / "held"
    common = ["bench", "--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]),
              "--prompts", str(tiny_prompts), "--methods", "ar,spec:k=2", "--max-prompts", "1", "--max-new-tokens",
              "8", "--dtype", "float32", "--threads", "1"]
    result = CliRunner().invoke(app, [*common, "--context", "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    settings = summary["settings"]
    assert settings["context"] == 64 and settings["held_context"] == {"target": 64, "draft": 64}
    assert summary["costs"]["context"] == 64 - 8  # the target held 64 positions, less the widest pass
    assert summary["methods"]["spec:k=2"]["greedy_exact"] == 1.0
    assert "- held_context: `{'target': 64, 'draft': 64}`" in (out / "report.md").read_text()
    assert settings_id(settings, True) != settings_id({**settings, "context": None}, True)
    refused = CliRunner().invoke(app, [*common, "--context", "200", "--out", str(tmp_path / "refused")])
    assert refused.exit_code == 2
    assert f"--context 200 is past the 128 positions {tiny_model_dirs['target']} has" in refused.stderr

@pytest.mark.parametrize("extra, message", [
    (["--turns", "3"], "--turns must be 1"),
    (["--turns", "2", "--no-chat"], "drop --no-chat"),
    (["--methods", "ar,beam"], "Unknown method 'beam'"),
    (["--categories", "maths"], "Unknown category 'maths'"),
])
def test_bench_cli_clear_errors(tiny_model_dirs, tiny_prompts, tmp_path, extra, message):
    result = CliRunner().invoke(app, ["bench", "--target", str(tiny_model_dirs["target"]), "--prompts",
                                      str(tiny_prompts), "--out", str(tmp_path / "o"), *extra])
    assert result.exit_code == 2
    assert message in result.stderr


# ----- the llama-cpp peer (no llama-cpp-python needed: its absence and a fake stand in) -----------------------


def test_llama_cpp_method_strings():
    plain = parse_method("llama-cpp")
    assert (plain.name, plain.options, plain.info.own_numerics) == ("llama-cpp", {}, True)
    sampled = parse_method("llama-cpp:temperature=0.7;seed=3")
    assert sampled.options == {"temperature": 0.7, "seed": 3}
    sampling = sampled.params(24).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed) == (0.7, 0, 1.0, 3)
    assert [m.label for m in parse_methods("ar,llama-cpp,llama-cpp:top-k=5;temperature=1")] == \
        ["ar", "llama-cpp", "llama-cpp:top-k=5;temperature=1"]


@pytest.mark.parametrize("text, key", [("llama-cpp:k=4", "k"), ("llama-cpp:draft-quant=int4", "draft-quant"),
                                       ("llama-cpp:n-gpu-layers=1", "n-gpu-layers")])
def test_llama_cpp_rejects_unknown_keys(text, key):
    with pytest.raises(SpecdraftError, match=f"Unknown option '{key}' for method 'llama-cpp'.*temperature, top-k"):
        parse_method(text)


@pytest.fixture()
def gguf_file(tmp_path):
    path = tmp_path / "model.gguf"  # never opened: the fake Llama or the import error comes first
    path.write_bytes(b"GGUF")
    return path


def test_llama_cpp_missing_package_is_a_clear_error(gguf_file, tiny_prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(SpecdraftError, match=r"llama-cpp-python.*make peers"):
        METHODS["llama-cpp"].check(str(gguf_file))
    models = Models(SimpleNamespace(eos_token_ids={2}), target_spec=str(gguf_file))
    with pytest.raises(SpecdraftError, match="make peers"):
        METHODS["llama-cpp"].run(models, [1, 2, 3], parse_method("llama-cpp").params(4))
    # the bench fails before loading any model (the .gguf here is not a model at all)
    result = CliRunner().invoke(app, ["bench", "--target", str(gguf_file), "--prompts", str(tiny_prompts),
                                      "--methods", "ar,llama-cpp", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "make peers" in result.stderr


def test_llama_cpp_needs_a_gguf_target(tiny_model_dirs, tiny_config):
    with pytest.raises(SpecdraftError, match=r"GGUF file.*is a folder.*--target"):
        METHODS["llama-cpp"].check(str(tiny_model_dirs["target"]))
    with pytest.raises(SpecdraftError, match="is a folder"):
        run_bench(tiny_config(methods="ar,llama-cpp"))


class FakeLlamaCpp:
    """Stands in for the llama_cpp module: a Llama that replays a script of tokens, a recording sampler API."""

    def __init__(self, script):
        self.script, self.made, self.chain = script, [], []
        outer = self

        class Llama:
            def __init__(self, path, **kwargs):
                outer.made.append((path, kwargs))
                self.kwargs, self.fed = kwargs, []

            def n_ctx(self):
                return self.kwargs["n_ctx"]

            def reset(self):
                self.fed = []

            def eval(self, tokens):
                self.fed.append(list(tokens))

            @property
            def ctx(self):
                return self
        self.Llama = Llama

    def llama_sampler_chain_default_params(self):
        return None

    def llama_sampler_chain_init(self, params):
        self.chain, self.step = [], 0
        return "chain"

    def llama_sampler_chain_add(self, chain, part):
        self.chain.append(part)

    def llama_sampler_free(self, chain):
        self.chain.append("freed")

    def llama_sampler_init_greedy(self):
        return ("greedy",)

    def llama_sampler_init_temp(self, t):
        return ("temp", t)

    def llama_sampler_init_top_k(self, k):
        return ("top-k", k)

    def llama_sampler_init_top_p(self, p, min_keep):
        return ("top-p", p)

    def llama_sampler_init_dist(self, seed):
        return ("dist", seed)

    def llama_sampler_sample(self, chain, ctx, idx):
        self.step += 1
        return self.script[self.step - 1]

    def llama_print_system_info(self):
        return b"CPU : SSE3 = 1 | AVX2 = 1 | "


def test_llama_cpp_run_with_a_fake_llama(gguf_file, monkeypatch):
    fake = FakeLlamaCpp(script=[5, 6, 2, 7, 8])  # 2 is an EOS id
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    models = Models(SimpleNamespace(eos_token_ids={2, 9}), target_spec=str(gguf_file))
    run = METHODS["llama-cpp"].run
    output = run(models, [1, 3, 4], parse_method("llama-cpp").params(10))
    assert output.token_ids == [5, 6, 2] and output.wall_seconds >= 0 and output.steps is None  # stops at EOS
    (path, kwargs), = fake.made
    assert path == str(gguf_file) and kwargs["n_ctx"] >= 13 and kwargs["n_threads"] == torch.get_num_threads()
    llama, _ = models.peers["llama-cpp"]
    assert llama.fed == [[1, 3, 4], [5], [6]]  # our prompt ids, then each token but the last
    assert fake.chain == [("greedy",), "freed"]
    output = run(models, [1], parse_method("llama-cpp:temperature=0.7;top-k=5;top-p=0.9;seed=3").params(2))
    assert output.token_ids == [5, 6] and len(fake.made) == 1  # the budget; the same Llama
    assert fake.chain == [("temp", 0.7), ("top-k", 5), ("top-p", 0.9), ("dist", 3), "freed"]  # our warping order
    run(models, list(range(2000)), parse_method("llama-cpp").params(4))
    assert len(fake.made) == 2 and fake.made[1][1]["n_ctx"] >= 2004  # a longer prompt: a larger context


def test_machine_block_records_what_llama_cpp_reports(monkeypatch):
    from specdraft.bench.runner import machine_info

    monkeypatch.setitem(sys.modules, "llama_cpp", FakeLlamaCpp(script=[]))
    info = machine_info(torch.device("cpu"), llama_cpp=True)
    assert info["llama_cpp_system_info"] == "CPU : SSE3 = 1 | AVX2 = 1 |"  # bytes decoded
    assert set(info["kernels"]) == {"isa", "tiles", "int8_activations", "avx_vnni", "SPECDRAFT_ISA", "tile_dots"}
    assert "llama_cpp_system_info" not in machine_info(torch.device("cpu"))


def test_llama_cpp_build_turns_amx_off_only_where_the_os_refuses_it():
    from specdraft.bench.llama_cpp_build import NATIVE, NO_AMX, cmake_args

    def never():
        raise AssertionError("no AMX on the CPU: nothing to ask the OS")

    assert cmake_args({"avx2", "fma"}, granted=never) == NATIVE == ["-DGGML_NATIVE=ON"]
    assert cmake_args({"avx512f", "amx_tile"}, granted=lambda: True) == NATIVE
    refused = cmake_args({"avx512f", "amx_tile"}, granted=lambda: False)
    assert refused == NATIVE + NO_AMX and "-DGGML_AMX_INT8=OFF" in refused
    assert any(arg.startswith("-DCMAKE_CXX_FLAGS=") and "-mno-amx-int8" in arg for arg in refused)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_system_info_of_the_installed_build():
    from specdraft.bench.llama_cpp_peer import system_info

    info = system_info()
    assert info and "CPU" in info


def test_summary_reports_agreement_not_exactness_for_own_numerics():
    peer = [rec(1, "code", "llama-cpp", 10, 0.5, SAME), rec(2, "prose", "llama-cpp", 6, 0.5, OTHER)]
    records = [r for r in RECORDS if r["method"] == "ar"] + peer
    s = summarize(records, "ar", {(2, "llama-cpp"): False}, own_numerics=["llama-cpp"])
    figures = s["llama-cpp"]
    assert figures["own_numerics"] and not s["ar"]["own_numerics"]
    assert figures["greedy_exact"] is None and figures["categories"]["prose"]["greedy_exact"] is None
    # prompt 1 identical (10 of 10); prompt 2 parts at token 3 of the longer 10 (ar's SAME vs OTHER's 6)
    assert figures["agreement"] == pytest.approx((10 + 3) / (10 + 10))
    assert summarize(records[:2] + [rec(2, "prose", "x", 6, 1.0, SAME[:6])])["x"]["agreement"] == 0.6  # a prefix
    assert figures["categories"]["code"]["agreement"] == 1.0
    assert s["ar"]["agreement"] == 1.0
    assert find_mismatches(records, "ar", {}, own_numerics=["llama-cpp"]) == []
    assert find_mismatches(records, "ar", {}) == [(2, "llama-cpp")]  # unmarked, the same output would fail
    check_exactness(records, "ar", {}, own_numerics=["llama-cpp"])
    report = render_report({"methods": s})
    assert "| `llama-cpp` |" in report and "n/a" in report and "agreement" in report and "own numerics" in report
    assert "agreement" not in render_report({"methods": summarize(RECORDS, "ar", NEAR_TIES)})


def test_k_auto_is_for_spec_only():
    assert parse_method("spec:k=auto").params(16).k == "auto"
    assert parse_method("spec:k=AUTO").params(16).k == "auto"
    assert parse_method("spec:k=4").params(16).k == 4
    with pytest.raises(SpecdraftError, match="k=auto is for spec only"):
        parse_method("hf-assisted:k=auto").params(16)


def test_mean_k_and_the_k_histogram_come_from_the_steps():
    from specdraft.bench.summary import k_histogram, mean_k

    records = [{"steps": 4, "drafted": 6, "k_per_step": [0, 2, 2, 2]}, {"steps": 2, "drafted": 6, "k_per_step": [3, 3]},
               {"steps": None, "drafted": None, "k_per_step": None}]  # a peer: no steps
    assert mean_k(records) == pytest.approx(12 / 6)
    assert k_histogram(records) == {0: 1, 2: 3, 3: 2}
    assert mean_k(records[2:]) is None and k_histogram(records[2:]) == {}


def test_several_prompt_files_join_with_their_names(tmp_path):
    from specdraft.prompts import load_prompt_files

    a, b = tmp_path / "spec.jsonl", tmp_path / "mine.jsonl"
    a.write_text('{"question_id": 1, "category": "qa", "turns": ["x"]}\n')
    b.write_text('{"question_id": 1, "category": "code", "turns": ["y"]}\n')
    joined = load_prompt_files([a, b])
    assert [(p.question_id, p.category) for p in joined] == [("spec:1", "qa"), ("mine:1", "code")]
    assert load_prompt_files([a])[0].question_id == 1
    b2 = tmp_path / "other" / "spec.jsonl"
    b2.parent.mkdir()
    b2.write_text(b.read_text())
    with pytest.raises(SpecdraftError, match="distinct names"):
        load_prompt_files([a, b2])


def test_drafter_keys_of_spec():
    spec = parse_method("spec:drafter=ngram+model;ngram-min=3;draft-confidence=0.2;k=4")
    params = spec.params(16)
    assert (params.drafter, dict(params.drafter_options)) == ("ngram+model", {"ngram-min": 3, "draft-confidence": 0.2})
    assert spec.needs_draft and not parse_method("spec:drafter=suffix").needs_draft
    with pytest.raises(SpecdraftError, match="takes no option exit-layer.*in method"):
        parse_method("spec:drafter=ngram;exit-layer=3").params(16)
    with pytest.raises(SpecdraftError, match="Unknown drafter 'nope'"):
        parse_method("spec:drafter=nope").params(16)
    with pytest.raises(SpecdraftError, match="ngram-max must be a whole number"):
        parse_method("spec:ngram-max=big")


def test_bench_free_drafters_without_a_draft_model(tiny_model_dirs, tiny_prompts, tmp_path):
    """ngram and suffix need no draft; the report counts who drafted for a composed drafter."""
    out = tmp_path / "free"
    result = CliRunner().invoke(app, [
        "bench", "--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]),
        "--prompts", str(tiny_prompts), "--methods", "ar,spec:drafter=ngram;k=3,spec:drafter=suffix;k=3,"
        "spec:drafter=ngram+model;k=3;ngram-min=1", "--max-prompts", "1", "--max-new-tokens", "24",
        "--dtype", "float32", "--threads", "1", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    for figures in summary["methods"].values():
        assert figures["greedy_exact"] == 1.0
    composed = summary["methods"]["spec:drafter=ngram+model;k=3;ngram-min=1"]["by_source"]
    assert composed["model"]["drafted"] > 0 and sum(row["steps"] for row in composed.values()) > 0
    assert "## Who drafted" in (out / "report.md").read_text()


def test_a_method_can_name_its_own_draft_model(tiny_model_dirs, tiny_prompts, tmp_path):
    """`draft=PATH` runs that draft instead of the run's --draft (here the target itself, reading the whole prompt:
    every draft accepted)."""
    out = tmp_path / "own"
    own = f"spec:drafter=model;k=3;draft-quant=none;draft-context=0;draft={tiny_model_dirs['target']}"
    result = CliRunner().invoke(app, [
        "bench", "--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]),
        "--prompts", str(tiny_prompts), "--methods", f"ar,spec:drafter=model;k=3;draft-quant=none,{own}", "--max-prompts", "1",
        "--max-new-tokens", "24", "--dtype", "float32", "--threads", "1", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    methods = json.loads((out / "summary.json").read_text())["methods"]
    assert methods[own]["greedy_exact"] == 1.0 and methods[own]["acceptance_rate"] == 1.0
    assert methods["spec:drafter=model;k=3;draft-quant=none"]["acceptance_rate"] < 1.0
    missing = CliRunner().invoke(app, [
        "bench", "--target", str(tiny_model_dirs["target"]), "--prompts", str(tiny_prompts),
        "--methods", f"ar,spec:draft={tmp_path / 'nowhere'}", "--out", str(tmp_path / "o2")])
    assert missing.exit_code == 2 and "No such file or folder" in missing.output


def test_second_turns_continue_from_ars_reply(tiny_config, tmp_path):
    """--turns 2: each multi-turn question's second turn runs after its first, on the chat of the first turn,
    ar's reply and the second turn, for every method; single-turn questions run once."""
    path = tmp_path / "two_turns.jsonl"
    path.write_text(json.dumps({"question_id": 7, "category": "chat", "turns": ["def add(a, b)", "for i in range"]})
                    + "\n" + json.dumps({"question_id": 8, "category": "chat", "turns": ["The quick brown fox"]}) + "\n")
    result = run_bench(tiny_config(prompts=path, turns=2))
    assert [(r["question_id"], r["method"]) for r in result.records] == [
        (7, "ar"), (7, "spec:k=2"), ("7:turn2", "ar"), ("7:turn2", "spec:k=2"), (8, "ar"), (8, "spec:k=2")]
    by_key = {(r["question_id"], r["method"]): r for r in result.records}
    target = load_model(tiny_config().target, dtype="float32")
    reply = target.tokenizer.decode(by_key[(7, "ar")]["token_ids"], skip_special_tokens=True)
    chat = encode_messages(target.tokenizer, [{"role": "user", "content": "def add(a, b)"},
                                              {"role": "assistant", "content": reply},
                                              {"role": "user", "content": "for i in range"}])
    assert by_key[("7:turn2", "ar")]["prompt_tokens"] == len(chat) > by_key[(7, "ar")]["prompt_tokens"]
    assert by_key[("7:turn2", "spec:k=2")]["token_ids"] == by_key[("7:turn2", "ar")]["token_ids"]
    assert result.summary["settings"]["turns"] == 2 and result.summary["methods"]["spec:k=2"]["greedy_exact"] == 1.0
    again = run_bench(tiny_config(prompts=path, turns=2))  # resumed: everything is there, second turns included
    assert again.records == result.records
