"""The statistics of the distribution checks: a chi-square test of sampled counts against exact probabilities,
and the bias it can detect (its power).

A test over m cells, n samples, at level α rejects when the statistic X² exceeds the χ²(m - 1) quantile at
1 - α. Under a true distribution that differs from the expected one, X² is (for large n) noncentral χ²(m - 1, λ)
with λ = n · Σ (p'ᵢ - pᵢ)² / pᵢ. A bias of total variation δ = ½ Σ |p'ᵢ - pᵢ| has Σ (p'ᵢ - pᵢ)² / pᵢ ≥ 4δ²
(Cauchy-Schwarz: (Σ |dᵢ|)² ≤ Σ dᵢ²/pᵢ · Σ pᵢ), so every bias of total variation ≥ δ gives λ ≥ 4nδ². The test
catches each of them with probability ≥ `power` once 4nδ² reaches the λ at which the noncentral law passes the
quantile with that probability: `detectable_bias` and `samples_for_bias` compute the two sides of that. It is the
worst case over all biases of that size; most biases (mass moved onto or off a rare cell) are caught sooner.

Everything here runs on torch (`torch.special.gammaincc`), so `specdraft check` needs no SciPy; the tests check
these numbers against SciPy's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

DEFAULT_POWER = 0.9
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled (the chi-square approximation needs it)


def chi_square_sf(statistic: float, df: int) -> float:
    """P(χ²(df) > statistic): the p-value of a chi-square statistic."""
    if statistic <= 0:
        return 1.0
    value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                    torch.tensor(statistic / 2, dtype=torch.float64))
    return float(value)


def chi_square_quantile(alpha: float, df: int) -> float:
    """The x with P(χ²(df) > x) = alpha: where a test at level alpha starts rejecting."""
    low, high = 0.0, float(df)
    while chi_square_sf(high, df) > alpha:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if chi_square_sf(middle, df) > alpha else (low, middle)
    return high


def noncentral_chi_square_sf(x: float, df: int, noncentrality: float) -> float:
    """P(χ²(df, λ) > x): the noncentral law as a Poisson(λ / 2) mixture of central χ²(df + 2j)."""
    half = noncentrality / 2
    if half == 0:
        return chi_square_sf(x, df)
    last = int(half + 12 * math.sqrt(half) + 40)
    j = torch.arange(last + 1, dtype=torch.float64)  # [J]
    weights = torch.exp(j * math.log(half) - half - torch.lgamma(j + 1))  # [J] Poisson(λ / 2) probabilities
    tails = torch.special.gammaincc((df + 2 * j) / 2, torch.full_like(j, x / 2))  # [J]
    return float((weights * tails).sum())


def noncentrality_for_power(df: int, alpha: float, power: float = DEFAULT_POWER) -> float:
    """The least λ at which a chi-square test with `df` degrees of freedom at level `alpha` rejects with
    probability `power`."""
    critical = chi_square_quantile(alpha, df)
    low, high = 0.0, 1.0
    while noncentral_chi_square_sf(critical, df, high) < power:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if noncentral_chi_square_sf(critical, df, middle) < power else (low, middle)
    return high


def detectable_bias(samples: int, df: int, alpha: float, power: float = DEFAULT_POWER) -> float:
    """The least total variation δ such that every bias of at least δ over the cells is caught with probability
    ≥ `power` by a test of `samples` draws over `df` + 1 cells at level `alpha` (module doc: λ ≥ 4nδ²)."""
    return math.sqrt(noncentrality_for_power(df, alpha, power) / (4 * samples))


def samples_for_bias(bias: float, df: int, alpha: float, power: float = DEFAULT_POWER) -> int:
    """How many draws a test over `df` + 1 cells at level `alpha` needs to catch every bias of total variation
    `bias` with probability ≥ `power`."""
    return math.ceil(noncentrality_for_power(df, alpha, power) / (4 * bias * bias))


def pooled_cells(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cells a chi-square test compares: cells expected fewer than MIN_EXPECTED times pooled into one (a pool
    still under it joins the smallest other cell); cells the target can never produce are dropped, and a count in
    one fails outright (AssertionError)."""
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "committed a sequence the target can never produce"
    small = (expected < MIN_EXPECTED) & ~impossible
    big = ~small & ~impossible
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        if pooled_exp < MIN_EXPECTED and exp:
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
        else:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
    return np.asarray(obs, dtype=np.float64), np.asarray(exp, dtype=np.float64)


def chi_square_statistic(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's X² of `observed` counts against `expected` counts (same total) over the pooled cells
    (`pooled_cells`), and its degrees of freedom (0, with X² 0, where too few draws leave fewer than two cells)."""
    obs, exp = pooled_cells(np.asarray(observed, dtype=np.float64), np.asarray(expected, dtype=np.float64))
    if len(exp) < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of `observed` counts under `expected` counts (same total), cell by cell (`pooled_cells`)."""
    statistic, df = chi_square_statistic(observed, expected)
    assert df >= 1, "a chi-square test needs at least two cells"
    return chi_square_sf(statistic, df)
