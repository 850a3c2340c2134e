"""`specdraft bench` plots and the cost ratio: synthetic records in, PNG files and c out."""

import json

import pytest
from matplotlib.image import imread

from specdraft.bench import BenchConfig, render_report, run_bench, summarize
from specdraft.bench.plots import PLOTS, plot_speedup_vs_theory, write_plots
from specdraft.bench.summary import cost_ratio, max_k, position_counts

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rec(qid, category, method, new, wall, steps=None, drafted=None, accepted=None, accepted_at=None,
        drafted_at=None, draft_seconds=None, verify_seconds=None, k=None, old=False):
    record = {"question_id": qid, "category": category, "method": method, "new_tokens": new, "wall_seconds": wall,
              "steps": steps, "drafted": drafted, "accepted": accepted, "accepted_at": accepted_at,
              "drafted_at": drafted_at, "token_ids": list(range(new)), "temperature": 0.0}
    if not old:  # records written before these fields existed lack them
        record.update(draft_seconds=draft_seconds, verify_seconds=verify_seconds, k=k)
    return record


RECORDS = [
    rec(1, "code", "ar", 10, 1.0, steps=10, drafted=0, accepted=0, accepted_at=[], drafted_at=[],
        draft_seconds=0.001, verify_seconds=0.9),
    rec(1, "code", "spec", 12, 0.5, steps=4, drafted=12, accepted=8, accepted_at=[4, 3, 1], drafted_at=[4, 4, 4],
        draft_seconds=0.6, verify_seconds=0.8, k=3),
    rec(1, "code", "hf-assisted", 10, 0.8),
    rec(2, "prose", "ar", 20, 4.0, steps=20, drafted=0, accepted=0, accepted_at=[], drafted_at=[],
        draft_seconds=0.002, verify_seconds=3.8),
    rec(2, "prose", "spec", 20, 1.5, steps=6, drafted=18, accepted=14, accepted_at=[6, 5, 3], drafted_at=[6, 6, 6],
        draft_seconds=1.8, verify_seconds=1.2, k=4),
    rec(2, "prose", "hf-assisted", 20, 2.0),
    # an old record of a third prompt: counted everywhere except c and k
    rec(3, "prose", "spec", 10, 0.5, steps=3, drafted=9, accepted=6, accepted_at=[3, 2, 1], drafted_at=[3, 3, 3],
        old=True),
]


def test_cost_ratio_and_k_by_hand():
    spec = [r for r in RECORDS if r["method"] == "spec"]
    # (0.6 + 1.8) s / 30 drafted = 0.08 s; (0.8 + 1.2) s / 10 steps = 0.2 s; c = 0.4 (the old record is left
    # out; the mean of the records' own ratios, 0.25 and 0.5, would be 0.375)
    assert cost_ratio(spec) == pytest.approx(0.4)
    assert max_k(spec) == 4
    assert cost_ratio([r for r in RECORDS if r["method"] == "ar"]) is None  # nothing drafted
    assert cost_ratio([r for r in RECORDS if r["method"] == "hf-assisted"]) is None
    assert max_k([r for r in RECORDS if r["method"] == "ar"]) is None
    assert cost_ratio([r for r in spec if "k" not in r]) is None  # only old records


def test_summary_carries_c_and_k_and_old_records_still_summarise():
    s = summarize(RECORDS, "ar")
    assert s["spec"]["cost_ratio"] == pytest.approx(0.4) and s["spec"]["k"] == 4
    assert s["spec"]["categories"]["code"]["cost_ratio"] == pytest.approx((0.6 / 12) / (0.8 / 4))
    assert s["spec"]["categories"]["code"]["k"] == 3
    assert s["spec"]["acceptance_rate"] == pytest.approx(28 / 39)  # the old record still counts here
    assert s["ar"]["cost_ratio"] is None and s["ar"]["k"] is None
    assert s["hf-assisted"]["cost_ratio"] is None and s["hf-assisted"]["k"] is None
    old_only = summarize([r for r in RECORDS if "k" not in r or r["method"] == "ar"], "ar")
    assert old_only["spec"]["cost_ratio"] is None and old_only["spec"]["k"] is None


def test_report_shows_c_and_lists_the_plots():
    report = render_report({"methods": summarize(RECORDS, "ar")}, PLOTS)
    assert "| α | c | k |" in report
    assert "| 0.72 | 0.400 | 4 |" in report  # spec: α = 28 / 39, c, k
    assert "| `spec` | code | 2.40× | - | - | 3.00 | 0.67 | 0.250 |" in report  # (12 / 0.5) / (10 / 1.0); 8 / 12; no prefill timed
    for name in PLOTS:
        assert f"]({name})" in report
    assert "![" not in render_report({"methods": summarize(RECORDS, "ar")})


def test_position_counts_sum_per_method():
    counts = position_counts(RECORDS)
    assert set(counts) == {"spec"}  # ar drafted nothing, the peers have no counts
    assert counts["spec"] == ([13, 10, 5], [13, 13, 13])


def test_report_tables_acceptance_per_position():
    summary = summarize(RECORDS, "ar")
    assert summary["spec"]["acceptance_by_position"] == [1.0, 10 / 13, 5 / 13]
    assert "ar" not in [m for m, f in summary.items() if f["acceptance_by_position"]]
    report = render_report({"methods": summary})
    assert "## Acceptance per draft position" in report
    assert "| `spec` | 1.00 | 0.77 | 0.38 |" in report


def assert_png(path):
    assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(path).shape[:2]
    assert height > 100 and width > 100


def test_each_plot_is_written_as_a_png(tmp_path):
    summary = {"methods": summarize(RECORDS, "ar")}
    names = write_plots(summary, RECORDS, tmp_path)
    assert names == list(PLOTS) == ["speedup_by_category.png", "acceptance_by_position.png",
                                    "speedup_vs_theory.png", "tokens_per_second.png"]
    for name in names:
        assert_png(tmp_path / name)


def test_plots_with_nothing_to_show_are_still_written(tmp_path):
    peers_only = [r for r in RECORDS if r["method"] == "hf-assisted"]
    for name in write_plots({"methods": summarize(peers_only, "ar")}, peers_only, tmp_path):
        assert_png(tmp_path / name)


def test_theory_plot_places_the_measured_point_at_alpha_per_token(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn = []
    original = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((args, kwargs.get("label", "")))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Axes, "plot", spy)
    plot_speedup_vs_theory(summarize(RECORDS, "ar"), RECORDS, tmp_path / "t.png")
    (curve_x, curve_y), _ = drawn[0]
    assert curve_x[0] == 0.0 and curve_x[-1] == 1.0
    assert curve_y[-1] == pytest.approx((4 + 1) / (1 + 4 * 0.4))  # τ(1, k=4) / (1 + k·c)
    (point_x, point_y), label = drawn[1]
    # accepted 13 + 10 + 5 = 28 of tested 13 + min(13, 13) + min(10, 13) = 36; speedup 42 / 2.5 s over ar's 30 / 5 s
    assert point_x == [pytest.approx(28 / 36)] and point_y == [pytest.approx((42 / 2.5) / 6.0)]
    assert "measured" in label

    drawn.clear()  # with this machine's pass costs, a 5-token pass priced at 1.8 one-token passes
    costs = {"pass_seconds": {"1": 0.05, "2": 0.06, "4": 0.08, "8": 0.12}}
    plot_speedup_vs_theory(summarize(RECORDS, "ar"), RECORDS, tmp_path / "t.png", costs)
    (_, curve_y), label = drawn[0]
    assert curve_y[-1] == pytest.approx((4 + 1) / (0.09 / 0.05 + 4 * 0.4))


def test_theory_plot_prices_the_k_each_step_drafted_and_the_time_after_prefill(tmp_path, monkeypatch):
    """k=auto mixes plain steps and drafts of several k: the curve is Σ τ(α, k) / Σ (V(k+1)/V(1) + k·c) over the
    steps (not the largest k's curve), and the point is the speedup of the time after the prompt pass."""
    from matplotlib.axes import Axes

    drawn = []
    original = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: (drawn.append((a, kw.get("label", ""))), original(self, *a, **kw))[1])
    ar = rec(1, "prose", "ar", 10, 2.0, steps=10, drafted=0, accepted=0, accepted_at=[], drafted_at=[],
             draft_seconds=0.001, verify_seconds=1.0) | {"prefill_seconds": 1.0, "k_per_step": [0] * 10}
    spec = rec(1, "prose", "spec", 10, 1.8, steps=6, drafted=6, accepted=4, accepted_at=[2, 1, 1], drafted_at=[3, 1, 1],
               draft_seconds=0.12, verify_seconds=0.6, k=3) | {"prefill_seconds": 1.0, "k_per_step": [0, 0, 0, 1, 2, 3]}
    records = [ar, spec]
    costs = {"pass_seconds": {"1": 0.1, "2": 0.12, "3": 0.14, "4": 0.16}}
    plot_speedup_vs_theory(summarize(records, "ar"), records, tmp_path / "t.png", costs)
    (_, curve_y), label = drawn[0]
    c = (0.12 / 6) / (0.6 / 6)  # 0.2
    # at α = 1: steps of k 0, 0, 0, 1, 2, 3 commit 1 + 1 + 1 + 2 + 3 + 4 tokens for passes of 1, 1, 1, 1.2, 1.4, 1.6
    assert curve_y[-1] == pytest.approx(12 / (3 + 1.2 + 1.4 + 1.6 + 6 * c)) and "mean 1.00" in label
    (_, point_y), _ = drawn[1]
    assert point_y == [pytest.approx((10 / 0.8) / (10 / 1.0))]  # after prefill: 0.8 s against ar's 1.0 s


def test_the_runner_writes_plots_and_timing_fields(tiny_model_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "code", "turns": ["def add(a, b)"]}) + "\n")
    config = BenchConfig(out=tmp_path / "out", methods="ar,spec:k=2", target=str(tiny_model_dirs["target"]),
                         draft=str(tiny_model_dirs["draft"]), prompts=prompts, max_new_tokens=8, dtype="float32",
                         threads=1, warmup_tokens=2)
    result = run_bench(config)
    spec = next(r for r in result.records if r["method"] == "spec:k=2")
    assert spec["k"] == 2 and spec["draft_seconds"] > 0 and spec["verify_seconds"] > 0
    assert next(r for r in result.records if r["method"] == "ar")["k"] is None
    figures = json.loads((result.out / "summary.json").read_text())["methods"]["spec:k=2"]
    assert figures["k"] == 2 and figures["cost_ratio"] == pytest.approx(cost_ratio([spec]))
    report = (result.out / "report.md").read_text()
    for name in PLOTS:
        assert_png(result.out / name)
        assert f"]({name})" in report
