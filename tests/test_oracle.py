"""The bench-only `oracle` drafter: synthetic acceptance α on tiny random models, and its place in the bench."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.analysis.theory import token_acceptance
from specdraft.bench import parse_method, render_report, run_bench, summarize
from specdraft.bench.methods import METHODS
from specdraft.bench.runs import Models
from specdraft.bench.runner import BenchConfig
from specdraft.drafters import (DRAFTERS, DraftContext, OracleDrafter, check_not_bench_only, drafter_options,
                                make_drafter)
from specdraft.errors import SpecdraftError
from specdraft.policy import FixedK
from specdraft.server.decoders import DecoderPool
from specdraft.surfaces.cli import app

PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(10, 30)), [40, 41, 40, 41], [3, 9, 27, 17, 51], [60, 2, 33]]


def recorded(target, prompts, max_new_tokens, **oracle) -> tuple[OracleDrafter, dict[int, list[int]]]:
    """An oracle holding an `ar` run of each prompt, and those runs' outputs (by prompt index)."""
    drafter, outputs = OracleDrafter(**oracle), {}
    ar = SpeculativeDecoder(target)
    for i, prompt in enumerate(prompts):
        outputs[i] = ar.generate(prompt, max_new_tokens=max_new_tokens).token_ids
        drafter.record(prompt + outputs[i])
    return drafter, outputs


def run_all(target, drafter, prompts, outputs, k, max_new_tokens):
    """Speculative runs of every prompt with fixed k; each must equal ar. Returns their stats."""
    spec = SpeculativeDecoder(target, drafter, k=FixedK(k))
    runs = []
    for i, prompt in enumerate(prompts):
        got = spec.generate(prompt, max_new_tokens=max_new_tokens)
        assert got.token_ids == outputs[i]
        runs.append(got.stats)
    return runs


def test_alpha_one_accepts_every_draft(tiny_target, make_lm):
    target = make_lm(tiny_target)
    drafter, outputs = recorded(target, PROMPTS[:3], 30, alpha=1.0)
    for stats in run_all(target, drafter, PROMPTS[:3], outputs, 4, 30):
        assert stats.drafted > 0 and stats.accepted == stats.drafted
        assert set(stats.by_source()) <= {"oracle", "none"}
        assert stats.mean_committed_per_step > 4  # k + 1 a step but the budget's last


def test_alpha_zero_accepts_nothing(tiny_target, make_lm):
    target = make_lm(tiny_target)
    drafter, outputs = recorded(target, PROMPTS[:3], 30, alpha=0.0)
    for stats in run_all(target, drafter, PROMPTS[:3], outputs, 3, 30):
        assert stats.drafted > 0 and stats.accepted == 0
        assert stats.steps == 30  # one token a step: the target's recovered one


def test_per_token_acceptance_is_alpha(tiny_target, make_lm):
    """α = 0.8, k = 4: accepted / tested draft tokens within 4 binomial sigmas of 0.8, and the
    committed tokens per step near τ(0.8, 4); output equal to ar throughout."""
    alpha, k = 0.8, 4
    target = make_lm(tiny_target)
    drafter, outputs = recorded(target, PROMPTS, 200, alpha=alpha, seed=5)
    runs = run_all(target, drafter, PROMPTS, outputs, k, 200)
    accepted_at = [sum(s.accepted_at[i] for s in runs) for i in range(k)]
    drafted_at = [sum(s.drafted_at[i] for s in runs) for i in range(k)]
    tested = drafted_at[0] + sum(min(accepted_at[i - 1], drafted_at[i]) for i in range(1, k))
    assert tested > 1000
    measured = token_acceptance(accepted_at, drafted_at)
    assert abs(measured - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / tested)
    # The geometric law: a full-k step commits (1 - α^(k+1)) / (1 - α) on average (3.36); 4 sigmas of its mean.
    full = [a + 1 for s in runs for d, a in zip(s.k_per_step, s.accepted_per_step) if d == k]
    mean, tau = sum(full) / len(full), (1 - alpha ** (k + 1)) / (1 - alpha)
    spread = math.sqrt(sum((x - mean) ** 2 for x in full) / (len(full) - 1))
    assert abs(mean - tau) < 4 * spread / math.sqrt(len(full))


def test_seed_reproduces_and_order_does_not_matter(tiny_target, make_lm):
    target = make_lm(tiny_target)
    state = torch.random.get_rng_state()
    first, outputs = recorded(target, PROMPTS[:2], 40, alpha=0.5, seed=3)
    steps = [s.accepted_per_step for s in run_all(target, first, PROMPTS[:2], outputs, 3, 40)]
    again, _ = recorded(target, PROMPTS[:2], 40, alpha=0.5, seed=3)
    assert [s.accepted_per_step for s in run_all(target, again, PROMPTS[:2], outputs, 3, 40)] == steps
    # A request's draws depend on the seed and its prompt, not on what ran before it.
    alone, _ = recorded(target, PROMPTS[1:2], 40, alpha=0.5, seed=3)
    assert run_all(target, alone, PROMPTS[1:2], {0: outputs[1]}, 3, 40)[0].accepted_per_step == steps[1]
    other, _ = recorded(target, PROMPTS[:2], 40, alpha=0.5, seed=4)
    assert [s.accepted_per_step for s in run_all(target, other, PROMPTS[:2], outputs, 3, 40)] != steps
    assert torch.equal(torch.random.get_rng_state(), state)  # its own generator; the global one is untouched


def test_leaving_the_recording_or_its_end_proposes_nothing():
    drafter = OracleDrafter(alpha=1.0)
    drafter.record([1, 2, 3, 4, 5, 6])
    drafter.record([9, 8, 7])
    drafter.begin(torch.tensor([1, 2]))

    def ctx(sequence):
        return DraftContext(torch.tensor(sequence), SamplingParams(), torch.Generator(), None)

    assert drafter.propose(ctx([1, 2]), 3).tokens.tolist() == [3, 4, 5]
    assert drafter.propose(ctx([1, 2, 3, 4, 5]), 3).tokens.tolist() == [6]  # fewer: the recording ends
    assert drafter.source(ctx([1, 2, 3, 4, 5, 6]), frozenset()) is None
    assert drafter.propose(ctx([1, 2, 3, 4, 5, 6]), 3).k == 0
    drafter.begin(torch.tensor([1, 2]))
    assert drafter.source(ctx([1, 2, 3, 0]), frozenset()) is None  # the sequence left the recording
    assert drafter.propose(ctx([1, 2, 3, 0, 5]), 2).k == 0
    drafter.begin(torch.tensor([9]))
    assert drafter.propose(ctx([9]), 5).tokens.tolist() == [8, 7]
    wrong = OracleDrafter(alpha=0.0)
    wrong.record([5, 0, 1, 7])
    wrong.begin(torch.tensor([5]))
    assert wrong.propose(ctx([5]), 3).tokens.tolist() == [1, 0, 6]  # never the true token, always a valid id


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_alpha_out_of_range_is_refused(alpha):
    with pytest.raises(SpecdraftError, match="oracle-alpha"):
        OracleDrafter(alpha=alpha)


def test_clear_errors(tiny_target, make_lm):
    with pytest.raises(SpecdraftError, match="oracle-alpha"):
        make_drafter("oracle", {"oracle-alpha": 2.0})
    with pytest.raises(SpecdraftError, match="oracle-seed"):
        OracleDrafter(seed=1.5)
    with pytest.raises(SpecdraftError, match="non-empty"):
        OracleDrafter().record([])
    target = make_lm(tiny_target)
    unrecorded = SpeculativeDecoder(target, make_drafter("oracle"), k=3)
    with pytest.raises(SpecdraftError, match=r"for benchmarks: it needs a recorded ar run of this prompt \(`record"):
        unrecorded.generate(PROMPTS[0], max_new_tokens=8)
    drafter, _ = recorded(target, PROMPTS[:1], 8)
    drafter.begin(torch.tensor(PROMPTS[1]))
    with pytest.raises(SpecdraftError, match="needs a recorded ar run"):
        drafter.propose(DraftContext(torch.tensor(PROMPTS[1]), SamplingParams(), torch.Generator(), None), 3)
    sampled = SpeculativeDecoder(target, drafter, k=3)
    with pytest.raises(SpecdraftError, match="greedy runs only"):
        sampled.generate(PROMPTS[0], SamplingParams(temperature=0.7), max_new_tokens=8)


def test_generate_and_serve_do_not_offer_it(tiny_target, make_lm):
    assert DRAFTERS["oracle"].bench_only and DRAFTERS["oracle"].description.startswith("bench only:")
    assert drafter_options("oracle") == {"oracle-alpha": 0.8, "oracle-seed": 0}
    check_not_bench_only("ngram+model")
    for name in ("oracle", "ngram+oracle"):
        with pytest.raises(SpecdraftError, match="for benchmarks only"):
            check_not_bench_only(name)
    result = CliRunner().invoke(app, ["generate", "hi", "--drafter", "oracle"])  # refused before anything loads
    assert result.exit_code == 2 and "for benchmarks only" in result.stderr
    pool = DecoderPool(make_lm(tiny_target), drafter="ngram")
    assert "oracle" not in pool.drafters()
    with pytest.raises(SpecdraftError, match="for benchmarks only"):
        pool.resolve("oracle")
    listing = CliRunner().invoke(app, ["drafters"])
    assert listing.exit_code == 0 and "bench only" in listing.stdout


# ----- the bench method -------------------------------------------------------------------------------------------


def test_bench_method_parses_and_checks():
    spec = parse_method("spec:drafter=oracle;oracle-alpha=0.7;oracle-seed=2;k=3")
    params = spec.params(16)
    assert params.drafter == "oracle" and params.k == 3 and not spec.needs_draft
    assert dict(params.drafter_options) == {"oracle-alpha": 0.7, "oracle-seed": 2}
    for text, message in [("spec:drafter=oracle", "oracle-alpha=0.8"),
                          ("spec:drafter=oracle;oracle-alpha=0.7;temperature=0.5", "greedy runs only"),
                          ("spec:drafter=oracle+ngram;oracle-alpha=0.7", "measures alone"),
                          ("spec:drafter=oracle;oracle-alpha=1.2", "oracle-alpha")]:
        with pytest.raises(SpecdraftError, match=message):
            parse_method(text).params(16)
    with pytest.raises(SpecdraftError, match="greedy runs only"):  # the run-wide temperature too
        parse_method("spec:drafter=oracle;oracle-alpha=0.7").params(16, temperature=0.7)


def test_bench_spec_records_ar_first(tiny_target, make_lm):
    target = make_lm(tiny_target)
    models = Models(target)
    expected = SpeculativeDecoder(target).generate(PROMPTS[0], max_new_tokens=20).token_ids
    output = METHODS["spec"].run(models, PROMPTS[0], parse_method("spec:drafter=oracle;oracle-alpha=1;k=4").params(20))
    assert output.token_ids == expected and output.accepted == output.drafted > 0
    (drafter,) = models.drafters.values()
    assert drafter.recordings == [PROMPTS[0] + expected]


def test_bench_run_labels_it_synthetic(tiny_model_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["def add(a, b)"]}) + "\n")
    label = "spec:drafter=oracle;oracle-alpha=0.6;k=3"
    result = run_bench(BenchConfig(out=tmp_path / "out", methods=f"ar,{label}", target=str(tiny_model_dirs["target"]),
                                   prompts=prompts, max_new_tokens=24, dtype="float32", threads=1, warmup_tokens=3))
    figures = result.summary["methods"][label]
    assert figures["greedy_exact"] == 1.0 and set(figures["by_source"]) <= {"oracle", "none"}
    assert figures["k"] == 3 and figures["cost_ratio"] is not None  # what the theory chart needs to draw it
    report = (result.out / "report.md").read_text()
    assert f"`{label}`: synthetic acceptance" in report
    assert "synthetic" not in render_report({"methods": summarize(result.records[:1], "ar")})  # ar alone: no note
