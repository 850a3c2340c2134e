"""The statistics behind every distribution test and `specdraft check`: p-values and power against SciPy's, the
worst-case bound that sizes the tests, and the cells of the target's exact distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from conftest import tiny_config
from specdraft.analysis.check import END, OTHER, count_cells, distribution_verdict, target_cells
from specdraft.exactness import exact_two_tokens
from specdraft.goodness_of_fit import (chi_square_pvalue, chi_square_quantile, chi_square_sf, detectable_bias,
                                       noncentral_chi_square_sf, noncentrality_for_power, samples_for_bias)
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import SamplingParams, warp


@pytest.mark.parametrize("df", [1, 3, 12, 63])
def test_chi_square_tails_match_scipy(df):
    for x in (0.5, df, 3.0 * df + 10):
        assert chi_square_sf(x, df) == pytest.approx(chi2.sf(x, df), rel=1e-9, abs=1e-300)
        for lam in (0.0, 5.0, 40.0):
            assert noncentral_chi_square_sf(x, df, lam) == pytest.approx(ncx2.sf(x, df, lam) if lam else chi2.sf(x, df),
                                                                         rel=1e-7)
    assert chi_square_quantile(1e-3, df) == pytest.approx(chi2.isf(1e-3, df), rel=1e-9)


@pytest.mark.parametrize("df", [3, 15, 63])
def test_the_noncentrality_for_power_gives_that_power(df):
    lam = noncentrality_for_power(df, 1e-3, 0.9)
    assert ncx2.sf(chi2.isf(1e-3, df), df, lam) == pytest.approx(0.9, abs=1e-6)


def test_pvalues_match_scipy_and_pool_rare_cells():
    observed = np.array([30, 25, 20, 15, 6, 2, 2])
    expected = np.array([28.0, 27.0, 18.0, 16.0, 7.0, 2.0, 2.0])
    assert chi_square_pvalue(observed, expected) == pytest.approx(
        chisquare([30, 25, 20, 15, 10], [28.0, 27.0, 18.0, 16.0, 11.0]).pvalue, rel=1e-9)  # 2 + 2 under 5: into 7
    with pytest.raises(AssertionError, match="never produce"):
        chi_square_pvalue(np.array([5, 5, 1]), np.array([5.5, 5.5, 0.0]))


def test_every_bias_of_the_detectable_size_is_caught_with_the_stated_power():
    """The sizing rule, simulated: the least favourable bias of total variation δ (half the mass of each half of
    the cells moved to the other: χ² divergence exactly 4δ²) is caught at α = 1e-3 by `samples_for_bias(δ)` draws in
    90% of 2,000 trials (less three standard errors: 0.88), and a bias of δ / 3 mostly is not (the rule is not
    vacuous)."""
    rng = np.random.default_rng(0)
    cells, delta, alpha = 16, 0.05, 1e-3
    p = np.full(cells, 1 / cells)
    n = samples_for_bias(delta, cells - 1, alpha)
    assert detectable_bias(n, cells - 1, alpha) == pytest.approx(delta, rel=1e-3)

    def caught(bias: float) -> float:
        shift = np.where(np.arange(cells) < cells // 2, 2 * bias / cells, -2 * bias / cells)  # TV = bias
        draws = rng.multinomial(n, p + shift, size=2000)
        return np.mean([chi_square_pvalue(row, p * n) < alpha for row in draws])

    assert caught(delta) >= 0.88
    assert caught(delta / 3) < 0.5


@pytest.fixture(scope="module")
def small_target():
    """A tiny random Qwen2 on an 8-token vocabulary (sharpened head), and the engine's view of it."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(7)
    model = Qwen2ForCausalLM(tiny_config(vocab_size=8, layers=2)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model, CausalLM(model)


def test_full_cells_are_the_exact_two_token_distribution(small_target):
    model, target = small_target
    prompt = [1, 2, 3, 4, 1, 2, 3]
    cells = target_cells(target, prompt, SamplingParams(temperature=1.0), depth=2, top=None)
    exact = exact_two_tokens(model, prompt)
    assert len(cells.paths) == 64
    assert max(abs(p - exact[a, b]) for (a, b), p in zip(cells.paths, cells.probabilities)) < 1e-6


def test_top_cells_warp_as_the_engine_does_and_count_answers(small_target):
    """Top-2 cells over three tokens with every warper on: each cell's probability is the product of the warped
    rows along its path (the repetition penalty counting the path), "other" holds the rest, and answers fall in
    the cell of their path."""
    model, target = small_target
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02, repetition_penalty=1.3)
    cells = target_cells(target, prompt, params, depth=3, top=2)
    assert cells.probabilities.sum() == pytest.approx(1.0)

    def row(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1:].float()
        seen = torch.zeros(1, 8, dtype=torch.bool)
        seen[0, prompt + list(prefix)] = True
        return warp(logits, params, seen)[0].double()

    first = row(())
    a, b = first.topk(2).indices.tolist()
    second = row((a,))
    c = second.topk(1).indices.item()
    third = row((a, c))
    d = third.topk(1).indices.item()
    index = cells.paths.index((a, c, d))
    assert cells.probabilities[index] == pytest.approx(float(first[a] * second[c] * third[d]), rel=1e-5)
    other_first = cells.paths.index((OTHER,))
    assert cells.probabilities[other_first] == pytest.approx(1 - float(first[a] + first[b]), rel=1e-5)
    assert cells.cell_of([a, c, d, 5]) == index
    never = int(first.argmin()) if float(first.min()) == 0 else None
    counts, impossible = count_cells(cells, [[a, c, d]] * 3 + ([[never, 0, 0]] if never is not None else []))
    assert counts[index] == 3 and impossible == (never is not None)
    verdict = distribution_verdict([(cells, counts, impossible)])
    assert not verdict.passed


def test_an_answer_that_ends_falls_in_its_end_cell(small_target):
    """End-of-sequence tokens share one END cell at each place, whether the answer shows its EOS token or was cut
    before it; an answer that ends where the target cannot is impossible."""
    model, _ = small_target
    model.generation_config.eos_token_id = 6
    try:
        target = CausalLM(model)
        assert target.eos_token_ids == {6}
        prompt = [1, 2, 3]
        cells = target_cells(target, prompt, SamplingParams(temperature=1.0), depth=2, top=None)
        first = cells.rows[()]
        assert cells.probabilities[cells.paths.index((END,))] == pytest.approx(float(first[6]), rel=1e-6)
        a = next(token for token in range(8) if token != 6 and float(first[token]) > 0)
        ended = cells.paths.index((a, END))
        assert cells.cell_of([a]) == ended and cells.cell_of([a, 6]) == ended
        assert all(6 not in path for path in cells.paths)
    finally:
        model.generation_config.eos_token_id = None
