"""`specdraft loadtest` against a live tiny server: figures per method and concurrency, outputs unchanged by load."""

from __future__ import annotations

import json
import socket

import pytest

from live_server import Live, make_app
from specdraft.bench.loadtest import (LATENCY_PLOT, REPORT, RESULTS, SUMMARY, THROUGHPUT_PLOT, batching_ceilings,
                                      parse_concurrency, parse_methods, passes_between, run_loadtest)
from specdraft.errors import SpecdraftError
from specdraft.prompts import Prompt

PROMPTS = [Prompt(f"p{i}", "test", [text]) for i, text in enumerate(
    ["the quick brown fox", "hello there, how are", "one two three four five", "a b c d e f g"])]


def test_loadtest_reports_each_level_and_method_with_outputs_unchanged_by_load(tiny_model_dirs, tmp_path):
    with Live(make_app(tiny_model_dirs, max_tokens=8)) as server:
        summary = run_loadtest(server.url, PROMPTS, ["ar", "spec"], [1, 4], tmp_path, max_tokens=8)
    assert set(summary["methods"]) == {"ar", "spec"}
    for method, levels in summary["methods"].items():
        assert list(levels) == ["1", "4"]
        assert levels["1"]["requests"] == len(PROMPTS) and levels["4"]["requests"] == 8
        for figures in levels.values():
            assert figures["errors"] == 0 and figures["tokens"] > 0 and figures["tokens_per_second"] > 0
            assert 0 < figures["ttft"]["p50"] <= figures["ttft"]["p95"]
            assert figures["same_as_alone"] == 1.0  # greedy answers do not change with load
    records = [json.loads(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    assert len(records) == 2 * (len(PROMPTS) + 8) and all(r["error"] is None for r in records)
    answers = {(r["method"], r["question_id"]) for r in records}
    assert all(r["text"] == next(q["text"] for q in records if (q["method"], q["question_id"]) == ("ar", r["question_id"]))
               for r in records if (r["method"], r["question_id"]) in answers)  # spec == ar, greedy
    for name in (SUMMARY, REPORT, THROUGHPUT_PLOT, LATENCY_PLOT):
        assert (tmp_path / name).stat().st_size > 0
    assert "| `spec` | 4 |" in (tmp_path / REPORT).read_text()
    # each level timed the passes it ran (the server's /metrics): `ar` alone steps one token a pass
    ar = summary["methods"]["ar"]
    assert set(ar["1"]["pass_counts"]) == {"1"} and ar["1"]["pass_counts"]["1"] >= len(PROMPTS)
    assert set(ar["4"]["pass_counts"]) <= {"1", "2", "3", "4"} and all(t > 0 for t in ar["4"]["pass_seconds"].values())
    ceiling = summary["batching"]["4"]
    assert ceiling["share"] == pytest.approx(ceiling["best_tokens_per_second"] / ceiling["ceiling_tokens_per_second"])
    assert "Batching against the cost of the passes this run timed" in (tmp_path / REPORT).read_text()


def test_loadtest_methods_take_turns_at_each_level_and_rounds_flip_their_order_and_pool(tiny_model_dirs, tmp_path):
    with Live(make_app(tiny_model_dirs, max_tokens=4)) as server:
        summary = run_loadtest(server.url, PROMPTS[:2], ["ar", "spec"], [2, 1], tmp_path, max_tokens=4, requests=2,
                               rounds=2)
    records = [json.loads(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    turns = [(r["round"], r["concurrency"], r["method"]) for r in records]
    assert list(dict.fromkeys(turns)) == [(0, 1, "ar"), (0, 1, "spec"), (0, 2, "ar"), (0, 2, "spec"),
                                          (1, 1, "spec"), (1, 1, "ar"), (1, 2, "spec"), (1, 2, "ar")]
    assert summary["rounds"] == 2
    for method, levels in summary["methods"].items():
        for clients, figures in levels.items():
            mine = [r for r in records if (r["method"], str(r["concurrency"])) == (method, clients)]
            assert figures["requests"] == 4 and figures["tokens"] == sum(r["tokens"] for r in mine)  # both rounds
            assert figures["same_as_alone"] == 1.0
            assert len(figures["tokens_per_second_by_round"]) == 2
            assert min(figures["tokens_per_second_by_round"]) <= figures["tokens_per_second"]
            assert figures["tokens_per_second"] <= max(figures["tokens_per_second_by_round"])
    report = (tmp_path / REPORT).read_text()
    assert "2 rounds pooled" in report and "| vs `ar` |" in report
    ratio = summary["methods"]["spec"]["2"]["tokens_per_second"] / summary["methods"]["ar"]["2"]["tokens_per_second"]
    ar_two = summary["methods"]["ar"]["2"]
    each = " / ".join(f"{r:.1f}" for r in ar_two["tokens_per_second_by_round"])
    assert f"| `ar` | 2 | 4 | 0 | {ar_two['tokens_per_second']:.1f} ({each}) | 1.00x |" in report
    assert f"| {ratio:.2f}x |" in report


def test_loadtest_refuses_bad_options_and_a_missing_server(tmp_path):
    with pytest.raises(SpecdraftError, match="--methods"):
        parse_methods("ar,medusa")
    for bad in ("", "0,2", "two"):
        with pytest.raises(SpecdraftError, match="--concurrency"):
            parse_concurrency(bad)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SpecdraftError, match="No server answers"):
        run_loadtest(f"http://127.0.0.1:{port}", PROMPTS, ["ar"], [1], tmp_path)
    with pytest.raises(SpecdraftError, match="--rounds"):
        run_loadtest(f"http://127.0.0.1:{port}", PROMPTS, ["ar"], [1], tmp_path, rounds=0)


def test_the_batching_ceiling_comes_from_the_passes_each_level_timed():
    """w · t(1) / t(w) × one client's `ar` tokens/s, w the batch `ar` stepped most at that level, against the best
    method there; the passes of a level are the difference of the server's sums before and after it."""
    assert passes_between({1: (2.0, 100)}, {1: (2.5, 120), 8: (0.4, 10)}) == {1: (0.5, 20), 8: (0.4, 10)}
    methods = {
        "ar": {"1": {"tokens_per_second": 40.0, "pass_seconds": {"1": 0.020}, "pass_counts": {"1": 500}},
               "8": {"tokens_per_second": 150.0, "pass_seconds": {"5": 0.030, "8": 0.032},
                     "pass_counts": {"5": 40, "8": 300}},
               "16": {"tokens_per_second": 151.0, "pass_seconds": {"8": 0.040}, "pass_counts": {"8": 300}}},
        "spec": {"1": {"tokens_per_second": 50.0}, "8": {"tokens_per_second": 160.0},
                 "16": {"tokens_per_second": None}},
    }
    ceilings = batching_ceilings(methods)
    assert set(ceilings) == {"8", "16"}
    eight = ceilings["8"]
    assert eight["width"] == 8 and eight["ceiling_tokens_per_second"] == pytest.approx(8 * 0.020 / 0.032 * 40.0)
    assert eight["best_method"] == "spec" and eight["share"] == pytest.approx(160.0 / 200.0)
    assert ceilings["16"]["ceiling_tokens_per_second"] == pytest.approx(8 * 0.020 / 0.040 * 40.0)  # the server's limit
    assert ceilings["16"]["best_method"] == "ar"
    assert batching_ceilings({"spec": methods["spec"]}) == {}  # no plain one-client level: no ceiling
