"""A chi-square goodness-of-fit test on counts, shared by the statistical exactness tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of `observed` counts under `expected` counts (same total), cell by cell.

    A count in a cell the target can never produce fails outright. Cells with expected count
    < 5 are pooled into one; a pool still under 5 joins the smallest cell.
    """
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "committed a sequence the target can never produce"
    small = (expected < 5) & ~impossible
    big = ~small & ~impossible
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        if pooled_exp < 5:
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
        else:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
    assert len(exp) >= 2
    return float(chisquare(np.array(obs), np.array(exp)).pvalue)
