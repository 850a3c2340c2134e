"""`specdraft costs`: predictions from measured pass costs by hand, the measurements on a tiny model, the CLI."""

import json

import pytest
from torch import nn
from typer.testing import CliRunner

from specdraft.analysis.costs import MachineCosts, best_prediction, measure_costs, predict, token_macs, weight_bytes
from specdraft.analysis.theory import expected_speedup
from specdraft.errors import SpecdraftError
from specdraft.surfaces.cli import app
from conftest import tiny_config, tiny_model

approx = pytest.approx


def costs_with(pass_seconds: dict[int, float], draft_seconds: float | None = None) -> MachineCosts:
    return MachineCosts(device="cpu", threads=2, context=300, pass_seconds=pass_seconds, draft_seconds=draft_seconds,
                        target_bytes=900_000_000, target_macs=1_500_000_000, stream_gb_per_s=34.0)


def test_speedup_with_a_measured_verify_ratio():
    # α = 0.8, k = 3: τ = 2.952; a step costs 3·0.1 + 1.75 one-token passes
    assert expected_speedup(0.8, 3, 0.1, 1.75) == approx(2.952 / 2.05)
    assert expected_speedup(0.8, 3, 0.1) == expected_speedup(0.8, 3, 0.1, 1.0)  # flat passes: the classic formula


def test_best_k_by_hand_from_pass_ratios():
    ratios = {1: 1.0, 2: 1.2, 3: 1.5}
    # c = 0.1: k = 1 gives 1.8 / 1.3 = 1.385, k = 2 gives 2.44 / 1.7 = 1.435
    best = best_prediction(0.8, 0.1, ratios)
    assert (best.k, best.speedup, best.tau) == (2, approx(2.44 / 1.7), approx(2.44))
    # every extra token costs a whole pass: no k beats plain decoding, even with a free draft
    plain = best_prediction(0.9, 0.0, {1: 1.0, 2: 2.0, 3: 3.0})
    assert (plain.k, plain.speedup, plain.tau) == (0, 1.0, 1.0)


def test_predict_compares_the_draft_a_free_draft_and_flat_passes():
    costs = costs_with({1: 0.030, 2: 0.031, 3: 0.038, 4: 0.045}, draft_seconds=0.009)
    report = predict(costs, [0.5, 0.9])
    assert costs.draft_ratio == approx(0.3)
    assert [p.alpha for p in report.draft] == [0.5, 0.9]
    for draft, free, flat in zip(report.draft, report.free, report.flat):
        assert draft.speedup <= free.speedup <= flat.speedup  # a dearer draft or dearer passes never predict more
    assert report.flat[1].k == 3 and report.flat[1].speedup == approx((1 - 0.9 ** 4) / 0.1)
    assert json.loads(json.dumps(report.to_dict()))["costs"]["pass_seconds"]["4"] == 0.045
    with pytest.raises(SpecdraftError, match="--alpha"):
        predict(costs, [1.5])


def test_rates_implied_by_the_measurements():
    costs = costs_with({1: 0.030, 2: 0.032, 3: 0.034})
    assert costs.extra_token_seconds == approx(0.002)
    assert costs.extra_token_gmacs == approx(1.5e9 / 0.002 / 1e9)
    assert costs.weights_gb_per_s == approx(0.9e9 / 0.030 / 1e9)
    assert costs_with({1: 0.03}).extra_token_seconds is None
    assert costs.draft_ratio is None


def test_the_memory_rates_drift_is_shown():
    from specdraft.analysis.render import pass_cost_table
    from rich.console import Console

    steady, moved = costs_with({1: 0.03, 2: 0.032}), costs_with({1: 0.03, 2: 0.032})
    steady.stream_after_gb_per_s, moved.stream_after_gb_per_s = 35.0, 20.0
    assert steady.stream_drift == approx(1 / 34) and moved.stream_drift == approx(0.7)

    def shown(costs):
        console = Console(width=400, record=True)
        console.print(pass_cost_table(costs))
        return console.export_text()
    assert "moved" not in shown(steady) and "moved 70%" in shown(moved)


def test_measure_on_a_tiny_model(make_lm):
    target = make_lm(tiny_model(tiny_config(), seed=1))
    draft = make_lm(tiny_model(tiny_config(), seed=2))
    costs = measure_costs(target, draft, widths=[3, 1, 2], context=16, repeats=2)
    assert sorted(costs.pass_seconds) == [1, 2, 3] and all(s > 0 for s in costs.pass_seconds.values())
    assert costs.draft_seconds > 0 and costs.stream_gb_per_s > 0 and costs.stream_after_gb_per_s > 0
    assert costs.draft_bytes == weight_bytes(draft) and costs.draft_gb_per_s > 0
    assert target.cache_len == 0  # left as found: empty
    model = target.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert costs.target_macs == sum(m.weight.numel() for m in linears)  # the embedding table is not multiplied
    assert costs.target_bytes == sum(p.numel() * 4 for name, p in model.named_parameters()
                                     if not name.startswith("model.embed_tokens")) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


def test_a_tied_head_counts_once(make_lm):
    model = tiny_model(tiny_config(), seed=1)
    model.lm_head.weight = model.model.embed_tokens.weight
    lm = make_lm(model)
    head = model.lm_head.weight
    assert token_macs(lm) == sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert weight_bytes(lm) >= head.numel() * head.element_size()  # the shared table is read by the head


def test_measure_rejects_bad_settings(make_lm):
    target = make_lm(tiny_model(tiny_config(max_positions=64), seed=1))
    with pytest.raises(SpecdraftError, match="must include 1"):
        measure_costs(target, widths=[2, 3])
    with pytest.raises(SpecdraftError, match="lower --context"):
        measure_costs(target, widths=[1, 8], context=60)
    with pytest.raises(SpecdraftError, match="--repeats"):
        measure_costs(target, repeats=0)


def test_costs_cli(tiny_model_dirs, tmp_path):
    runner = CliRunner()
    out = tmp_path / "costs.json"
    models = ["--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"]), "--dtype", "float32"]
    result = runner.invoke(app, ["costs", *models, "--context", "16", "--widths", "1,2,3", "--repeats", "1",
                                 "--alpha", "0.6,0.9", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "expected speedup" in result.output and "free draft" in result.output
    saved = json.loads(out.read_text())
    assert set(saved["costs"]["pass_seconds"]) == {"1", "2", "3"} and len(saved["draft"]) == 2
    assert "kernels: " in result.output and saved["kernels"]["isa"] in ("torch", "avx2", "avx512", "amx")  # in use
    result = runner.invoke(app, ["costs", *models, "--draft", "", "--widths", "2,3"])
    assert result.exit_code == 2 and "must include 1" in result.output


def test_costs_cli_loads_gguf_files_as_asked(monkeypatch):
    """`--gguf-weights` reaches the loader, as in `generate` and `bench` (unpacked: memory-bound passes)."""
    asked = []

    def loader(name, **options):
        asked.append(options.get("gguf_weights"))
        raise SpecdraftError("stopped before loading")

    monkeypatch.setattr("specdraft.models.loading.load_model", loader)
    result = CliRunner().invoke(app, ["costs", "--gguf-weights", "unpacked"])
    assert result.exit_code == 2 and "stopped before loading" in result.output and asked == ["unpacked"]
