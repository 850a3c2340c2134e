"""`specdraft diagnose`: the per-position metrics by hand and on tiny models, predicted against measured α, the CLI."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import perturbed, tiny_config, tiny_model
from specdraft.analysis.diagnose import (MeasuredRun, compare_positions, diagnose_prompt, greedy_output,
                                         metric_params, overall, rolling_mean, teacher_force)
from specdraft.run import ACCEPTED, BONUS, RECOVERED, StepEvent
from specdraft.sampling import SamplingParams
from specdraft.surfaces.cli import app

PROMPT = [3, 17, 42, 5, 9, 11]
LN3 = math.log(3.0)


# ----- the metrics on hand-built logits ------------------------------------------------------------------------
def test_metrics_by_hand():
    target = torch.tensor([[LN3, 0.0], [LN3, 0.0]])  # p = [0.75, 0.25] at temperature 1
    draft = torch.tensor([[0.0, LN3], [2 * LN3, 0.0]])  # q = [0.25, 0.75]; q = [0.9, 0.1]
    m = compare_positions(target, draft, SamplingParams(temperature=1.0))
    assert m.agreement == [False, True]
    assert m.expected_acceptance == pytest.approx([0.25 + 0.25, 0.75 + 0.1])
    assert m.total_variation == pytest.approx([0.5, 0.15])
    assert m.logit_cosine == pytest.approx([0.0, 1.0], abs=1e-6)  # orthogonal; parallel
    assert m.hidden_cosine is None
    assert m.means()["agreement"] == 0.5 and m.means()["hidden_cosine"] is None


def test_temperature_of_the_distribution_metrics():
    assert metric_params(0.0).temperature == 1.0  # greedy: the distributions at temperature 1
    assert metric_params(0.7).temperature == 0.7
    target, draft = torch.tensor([[LN3, 0.0]]), torch.tensor([[0.0, 0.0]])
    at_two = compare_positions(target, draft, metric_params(2.0))  # p = [√3, 1] / (√3 + 1), q uniform
    assert at_two.expected_acceptance == pytest.approx([0.5 + 1 / (math.sqrt(3) + 1)])


def test_hidden_cosine_only_where_sizes_match():
    logits = torch.randn(3, 8)
    h = torch.randn(3, 4)
    assert compare_positions(logits, logits, metric_params(0), h, 2 * h).hidden_cosine == pytest.approx([1.0] * 3)
    assert compare_positions(logits, logits, metric_params(0), h, torch.randn(3, 6)).hidden_cosine is None


def test_rolling_mean_and_measured_alpha():
    assert rolling_mean([1, 0, 1, 1], 2) == [1.0, 0.5, 0.5, 1.0]
    assert rolling_mean([True, False, False], 8) == pytest.approx([1.0, 0.5, 1 / 3])
    run = MeasuredRun(steps=4, drafted=12, accepted=6, rejected=3, new_tokens=10)
    assert run.alpha == pytest.approx(6 / 9) and run.acceptance_rate == pytest.approx(6 / 12)
    assert MeasuredRun().alpha is None and MeasuredRun().acceptance_rate is None


def test_measured_run_counts_rejections_from_recovered_tokens():
    run = MeasuredRun()
    run.record(StepEvent([1, 2, 3], [ACCEPTED, ACCEPTED, RECOVERED], ["a", "b", "c"], drafted=3, accepted=2))
    run.record(StepEvent([4, 5, 6, 7], [ACCEPTED] * 3 + [BONUS], list("defg"), drafted=3, accepted=3))
    # cut at EOS after two accepted tokens: nothing tested was rejected
    run.record(StepEvent([8, 9], [ACCEPTED, ACCEPTED], ["h", "i"], drafted=3, accepted=2, finish_reason="stop"))
    assert (run.steps, run.drafted, run.accepted, run.rejected, run.new_tokens) == (3, 9, 7, 1, 9)
    assert run.alpha == pytest.approx(7 / 8) and run.acceptance_rate == pytest.approx(7 / 9)


# ----- on tiny models ------------------------------------------------------------------------------------------
@pytest.fixture()
def lm(make_lm, tiny_target):
    return lambda model=tiny_target: make_lm(model)


def test_teacher_forcing_lines_up_with_the_greedy_output(lm):
    target = lm()
    output = greedy_output(target, PROMPT, 12)
    logits, hidden = teacher_force(target, PROMPT, output.token_ids)
    assert logits.shape == (12, target.vocab_size) and hidden.shape == (12, 32)
    assert logits.argmax(-1).tolist() == output.token_ids  # row j predicts output token j
    assert target.cache_len == 0 and len(output.pieces) == len(output.token_ids)


def test_an_identical_draft_agrees_everywhere(lm):
    d = diagnose_prompt(lm(), lm(), PROMPT, max_new_tokens=12, measure_k=3)
    m = d.metrics
    assert len(m) == 12 and all(m.agreement)
    assert m.expected_acceptance == pytest.approx([1.0] * 12, abs=1e-5)
    assert m.total_variation == pytest.approx([0.0] * 12, abs=1e-5)
    assert m.logit_cosine == pytest.approx([1.0] * 12, abs=1e-5)
    assert m.hidden_cosine == pytest.approx([1.0] * 12, abs=1e-5)
    assert d.predicted_alpha == 1.0 and d.measured.alpha == 1.0 and d.measured.rejected == 0


def test_a_different_draft_scores_in_range_and_below_one(lm, tiny_target):
    target, draft = lm(), lm(perturbed(tiny_target, noise=0.3, seed=7))
    d = diagnose_prompt(target, draft, PROMPT, max_new_tokens=16, measure_k=3)
    m = d.metrics
    assert len(m) == 16
    for values in (m.expected_acceptance, m.total_variation, m.hidden_cosine):
        assert all(0.0 <= v <= 1.0 + 1e-6 for v in values)
    assert all(-1.0 <= v < 1.0 for v in m.logit_cosine)
    assert all(v < 1.0 - 1e-4 for v in m.expected_acceptance)
    assert [a + b for a, b in zip(m.expected_acceptance, m.total_variation)] == pytest.approx([1.0] * 16, abs=1e-5)
    assert 0.0 < d.predicted_alpha < 1.0 and d.predicted_alpha == pytest.approx(sum(m.agreement) / 16)
    assert 0.0 <= d.measured.alpha < 1.0 and d.measured.rejected > 0
    # greedy: the measured run tests the same argmaxes, on the same prefix, at all but its bonus positions
    assert abs(d.predicted_alpha - d.measured.alpha) < 0.25


def test_hidden_cosine_is_left_out_for_another_hidden_size(lm):
    config = tiny_config()
    config.hidden_size, config.head_dim = 48, 12
    d = diagnose_prompt(lm(), lm(tiny_model(config, seed=5)), PROMPT, max_new_tokens=6, measure_k=None)
    assert d.metrics.hidden_cosine is None and d.measured is None
    assert len(d.metrics.logit_cosine) == 6


def test_sampled_prediction_is_the_mean_overlap_and_pooling(lm, tiny_target):
    target, draft = lm(), lm(perturbed(tiny_target, noise=0.6, seed=7))
    sampled = diagnose_prompt(target, draft, PROMPT, max_new_tokens=8, temperature=0.8, measure_k=2)
    assert sampled.predicted_alpha == pytest.approx(sum(sampled.metrics.expected_acceptance) / 8)
    assert sampled.measured is not None and 0.0 <= sampled.measured.alpha <= 1.0
    greedy = diagnose_prompt(target, draft, PROMPT[:3], max_new_tokens=4, measure_k=2)
    pooled = overall([sampled, greedy], greedy=False)
    assert pooled["positions"] == 12
    assert pooled["predicted_alpha"] == pytest.approx(
        (sum(sampled.metrics.expected_acceptance) + sum(greedy.metrics.expected_acceptance)) / 12)
    runs = sampled.measured.add(greedy.measured)
    assert pooled["measured"]["accepted"] == runs.accepted and pooled["measured"]["alpha"] == runs.alpha


# ----- the command line ----------------------------------------------------------------------------------------
@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    items = [(11, "code", "def add(a, b)"), (21, "prose", "The quick brown fox")]
    path.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [t]}) + "\n" for q, c, t in items))
    return path


def test_diagnose_cli_writes_json_and_chart(tiny_model_dirs, prompts_file, tmp_path):
    out = tmp_path / "diag"
    result = CliRunner().invoke(app, [
        "diagnose", "--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]),
        "--prompts", str(prompts_file), "--max-new-tokens", "10", "--dtype", "float32", "--threads", "1",
        "--draft-quant", "none", "--k", "3", "--out", str(out),
    ], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    report = json.loads((out / "diagnose.json").read_text())
    assert [p["question_id"] for p in report["prompts"]] == [11, 21]
    for p in report["prompts"]:
        assert len(p["positions"]["agreement"]) == len(p["token_ids"]) == 10
        assert 0.0 <= p["predicted_alpha"] <= 1.0 and 0.0 <= p["measured"]["alpha"] <= 1.0
        assert p["positions"]["hidden_cosine"] is not None  # same hidden size
    assert report["overall"]["positions"] == 20 and report["overall"]["measured"]["alpha"] is not None
    assert report["settings"]["predicted_alpha"] == "mean top-1 agreement" and report["settings"]["k"] == 3
    assert (out / "agreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for text in ("question 11", "question 21", "α pred", "α meas", "all", "agreement.png"):
        assert text in result.stderr


def test_diagnose_cli_without_measuring(tiny_model_dirs, prompts_file):
    result = CliRunner().invoke(app, [
        "diagnose", "--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]),
        "--prompts", str(prompts_file), "--categories", "code", "--max-new-tokens", "6", "--dtype", "float32",
        "--threads", "1", "--no-measure",
    ], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "question 11" in result.stderr and "question 21" not in result.stderr
    assert "measured -" in result.stderr


@pytest.mark.parametrize("extra, message", [
    (["--k", "0"], "--k must be >= 1"),
    (["--draft-quant", "int8"], "Unknown draft quantization 'int8'"),
    (["--categories", "maths"], "Unknown category 'maths'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
])
def test_diagnose_cli_clear_errors(tiny_model_dirs, prompts_file, extra, message):
    result = CliRunner().invoke(app, ["diagnose", "--target", str(tiny_model_dirs["target"]), "--draft",
                                      str(tiny_model_dirs["draft"]), "--prompts", str(prompts_file), *extra])
    assert result.exit_code == 2
    assert message in result.stderr
