"""`specdraft theory`: τ and speedup by hand, the best k, per-token α from counts, input errors, the CLI."""

import math

import pytest
from typer.testing import CliRunner

from specdraft.analysis.theory import (best_k, expected_speedup, expected_tau, mixed_speedup, parse_list, pass_ratio_at,
                                       theory_grid, token_acceptance, validate)
from specdraft.errors import SpecdraftError
from specdraft.surfaces.cli import app

approx = pytest.approx


@pytest.mark.parametrize("alpha, k, tau", [
    (0.5, 2, 1.75),  # (1 - 0.125) / 0.5
    (0.8, 4, 3.3616),  # (1 - 0.32768) / 0.2
    (0.0, 5, 1.0),  # nothing accepted: only the target's own token
    (1.0, 5, 6.0),  # everything accepted: k + bonus
    (1.0, 1, 2.0),
])
def test_expected_tau_by_hand(alpha, k, tau):
    assert expected_tau(alpha, k) == approx(tau)


def test_tau_is_continuous_at_alpha_one():
    assert expected_tau(1 - 1e-9, 4) == approx(expected_tau(1.0, 4), rel=1e-6)


def test_mixed_speedup_by_hand():
    """Steps of several k (plain ones too) priced on measured passes; one k alone is expected_speedup."""
    passes = {"1": 0.1, "2": 0.15, "3": 0.2}
    # α = 0.5: k 0 commits 1, k 2 commits 1.75; passes 1 and 2 one-token passes, drafts 2·0.25
    assert mixed_speedup(0.5, {0: 2, 2: 1}, 0.25, passes) == approx((2 * 1 + 1.75) / (2 * 1 + 2 + 0.5))
    assert mixed_speedup(0.8, {4: 7}, 0.1, passes) == approx(expected_speedup(0.8, 4, 0.1, pass_ratio_at(passes, 5)))
    assert mixed_speedup(0.3, {0: 5}, 0.4, passes) == approx(1.0)  # plain steps only: plain decoding


def test_expected_speedup_by_hand():
    assert expected_speedup(0.8, 4, 0.05) == approx(3.3616 / 1.2)
    assert expected_speedup(0.0, 3, 0.1) == approx(1 / 1.3)  # drafting that never lands only costs
    assert expected_speedup(1.0, 4, 0.0) == approx(5.0)
    assert expected_speedup(0.5, 2, 0.25) == approx(1.75 / 1.5)


def test_best_k():
    # α = 0.8, c = 0.1: k = 5, 6, 7 give 2.4595, 2.4696, 2.4477
    assert best_k(0.8, range(1, 9), 0.1) == 6
    assert best_k(0.8, [7, 5], 0.1) == 5
    assert best_k(0.0, range(1, 9), 0.1) == 1  # the least drafting loses least
    assert best_k(0.0, [3, 1, 2], 0.0) == 1  # a tie (all 1.0): the smallest k
    assert best_k(1.0, range(1, 9), 0.0) == 8  # free, perfect drafts: the longest


def test_grid_marks_one_best_per_alpha():
    grid = theory_grid([0.6, 0.8, 0.95], [1, 2, 4, 8], 0.1)
    assert [[cell.k for cell in row] for row in grid] == [[1, 2, 4, 8]] * 3
    assert [sum(cell.best for cell in row) for row in grid] == [1, 1, 1]
    assert [next(cell.k for cell in row if cell.best) for row in grid] == [best_k(a, [1, 2, 4, 8], 0.1)
                                                                             for a in (0.6, 0.8, 0.95)]
    assert grid[1][2].tau == approx(3.3616) and grid[1][2].speedup == approx(3.3616 / 1.4)


def test_token_acceptance_from_position_counts():
    # k = 3, three steps accepting 3, 1 and 0: tested 3 + 2 + 1 = 6, accepted 4
    assert token_acceptance([2, 1, 1], [3, 3, 3]) == approx(4 / 6)
    assert token_acceptance([1, 1], [2, 2]) == approx(2 / 3)  # the docstring's example
    assert token_acceptance([0, 0], [5, 5]) == 0.0
    assert token_acceptance([], []) is None and token_acceptance([0], [0]) is None


@pytest.mark.parametrize("alphas, ks, c, message", [
    ([1.2], [1], 0.1, r"α must be in \[0, 1\], got 1.2"),
    ([-0.1], [1], 0.1, r"α must be in \[0, 1\]"),
    ([math.nan], [1], 0.1, r"α must be in \[0, 1\]"),
    ([0.5], [0], 0.1, "k must be >= 1, got 0"),
    ([0.5], [2], -0.5, "c .* must be >= 0"),
    ([], [2], 0.1, "at least one α"),
    ([0.5], [], 0.1, "at least one k"),
])
def test_bad_input_is_a_clear_error(alphas, ks, c, message):
    with pytest.raises(SpecdraftError, match=message):
        validate(alphas, ks, c)


def test_parse_list():
    assert parse_list("0.6, 0.8,,0.6", float, "--alpha") == [0.6, 0.8]
    assert parse_list("1,2,4", int, "--k") == [1, 2, 4]
    with pytest.raises(SpecdraftError, match="--k takes a comma list of whole numbers; got '2.5'"):
        parse_list("1,2.5", int, "--k")


# ----- the command line -----------------------------------------------------------------------------------------
def test_theory_cli_prints_tables_and_writes_the_chart(tmp_path):
    out = tmp_path / "charts" / "theory.png"
    result = CliRunner().invoke(app, ["theory", "--alpha", "0.8,1", "--k", "4,5,6,7", "--c", "0.1",
                                      "--out", str(out)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("│")}
    # the second table (speedup) overwrites the first (τ) in `rows`: α -> k=4..7 and best k
    assert rows["0.8"] == ["2.40", "2.46", "2.47*", "2.45", "6"]
    assert rows["1"] == ["3.57", "4.00", "4.38", "4.71*", "7"]
    assert "3.36" in result.stdout  # τ(0.8, 4) in the first table
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in result.stderr


def test_pass_ratio_from_measured_widths_interpolates_and_extrapolates():
    measured = {"1": 0.050, "2": 0.065, "4": 0.080, "8": 0.160}  # as summary.json stores them
    assert pass_ratio_at(measured, 1) == 1.0 and pass_ratio_at(measured, 4) == pytest.approx(1.6)
    assert pass_ratio_at(measured, 3) == pytest.approx(1.45)  # between 2 and 4
    assert pass_ratio_at(measured, 10) == pytest.approx((0.160 + 2 * 0.020) / 0.050)  # the slope of 4 -> 8
    assert pass_ratio_at({}, 5) == 1.0 and pass_ratio_at({1: 0.05}, 5) == 1.0


def test_a_pass_slope_prices_wide_steps():
    """Each extra verified token at a third of a one-token pass (an AVX2 CPU): long drafts stop paying."""
    flat, = theory_grid([0.8], [1, 2, 4, 8], 0.3)
    sloped, = theory_grid([0.8], [1, 2, 4, 8], 0.3, slope=1 / 3)
    assert sloped[2].speedup == pytest.approx(expected_tau(0.8, 4) / (1 + 4 / 3 + 4 * 0.3))
    assert all(s.speedup < f.speedup for s, f in zip(sloped, flat))
    assert next(c.k for c in sloped if c.best) < next(c.k for c in flat if c.best)
    with pytest.raises(SpecdraftError, match="slope"):
        theory_grid([0.8], [1], 0.1, slope=-1)


def test_theory_cli_takes_the_measured_slope():
    result = CliRunner().invoke(app, ["theory", "--alpha", "0.8", "--k", "1,4", "--c", "0.3", "--slope", "0.3333"],
                                env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "s = 0.3333" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--alpha", "1.5"], "α must be in [0, 1]"),
    (["--k", "0,2"], "k must be >= 1"),
    (["--k", "two"], "comma list of whole numbers"),
    (["--c", "-1"], "must be >= 0"),
    (["--alpha", ","], "at least one α"),
])
def test_theory_cli_exits_2_on_bad_input(args, message, tmp_path):
    result = CliRunner().invoke(app, ["theory", *args, "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "x.png").exists()
