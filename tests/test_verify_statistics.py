"""Tier 2 of the exactness tests (docs/design.md): a goodness-of-fit test on a toy Markov LM.

The "LM" is a Markov chain on a small vocabulary: the next-token logits depend only on the
last token. The target's transition logits are P, the draft's Q (different). Many rows
(the batch dimension) each start from the same token x0 and run one speculative step:
a chain of k = 3 draft tokens drawn from warp(Q), target rows warp(P) along
[x0, d1, d2, d3], and `verify_sampled`. The first two committed tokens must then follow
the target's own two-step distribution warp(P)[x0, a] * warp(P)[a, b] exactly; rows that
committed only one token in the first step take a second, vectorised step from there.

A chi-square test compares the joint counts of (a, b) with that distribution. The same test
must reject deliberately wrong verifiers (negative controls): told the wrong q, skipping
the residual, or not removing a deterministic proposal from its residual.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdraft.verify as verify_module
from specdraft.goodness_of_fit import chi_square_pvalue
from specdraft.sampling import SamplingParams, sample, warp
from specdraft.verify import verify_sampled
from seeded import gen, transition_logits

V = 7
K = 3
B = 40_000
X0 = 2
P_PASS = 1e-3  # the correct verifier must pass
P_REJECT = 1e-6  # a wrong verifier must fail


P_LOGITS, Q_LOGITS = transition_logits(20240607, V)

# How the draft is made: sampled from warp(Q) (q_draft given), or the argmax of Q (q_draft=None).
SAMPLED, ARGMAX = "sampled", "argmax"


def _draft_chain(
    start: torch.Tensor,  # [n] the last committed token of each row
    q_table: torch.Tensor,  # [V, V] warped draft transition rows the draft samples from
    mode: str,
    generator: torch.Generator,
    k: int,
) -> torch.Tensor:
    """`[n, k]` draft tokens continuing `start`."""
    tokens, last = [], start
    for _ in range(k):
        if mode == SAMPLED:
            last = sample(q_table[last], generator)  # [n]
        else:
            last = Q_LOGITS[last].argmax(-1)  # [n]
        tokens.append(last)
    return torch.stack(tokens, 1)


def _speculative_step(
    start: torch.Tensor,  # [n]
    params: SamplingParams,
    mode: str,
    generator: torch.Generator,
    told_q_params: SamplingParams | None = None,
    k: int = K,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One propose + verify step from `start`: (draft [n, k], num_accepted [n], next_token [n])."""
    p_table = warp(P_LOGITS, params)  # [V, V]
    q_table = warp(Q_LOGITS, params)
    draft = _draft_chain(start, q_table, mode, generator, k)
    path = torch.cat([start.unsqueeze(1), draft], 1)  # [n, k + 1]: x0, d1, d2, d3
    p_target = p_table[path]  # [n, k + 1, V]
    if mode == SAMPLED:
        told = q_table if told_q_params is None else warp(Q_LOGITS, told_q_params)
        q_draft = told[path[:, :k]]  # [n, k, V]: row i is what d_{i+1} was drawn from
    else:
        q_draft = None
    verdict = verify_sampled(draft, q_draft, p_target, generator)
    return draft, verdict.num_accepted, verdict.next_token


def _first_two_committed(params: SamplingParams, mode: str, seed: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two committed tokens (a, b) of B independent speculative generations from X0."""
    generator = gen(seed)
    start = torch.full((B,), X0, dtype=torch.long)
    draft, num, nxt = _speculative_step(start, params, mode, generator, **kwargs)
    first = torch.where(num >= 1, draft[:, 0], nxt)
    second = torch.where(num >= 2, draft[:, 1], nxt) if draft.shape[1] >= 2 else nxt.clone()
    only_one = num == 0  # these rows committed a single token: take a second step from it
    if only_one.any():
        draft2, num2, nxt2 = _speculative_step(first[only_one], params, mode, generator, **kwargs)
        second[only_one] = torch.where(num2 >= 1, draft2[:, 0], nxt2)
    return first, second


def _exact_two_step(params: SamplingParams) -> np.ndarray:
    """`[V, V]` target probability of committing (a, b) after X0."""
    p_table = warp(P_LOGITS, params).double().numpy()
    joint = p_table[X0][:, None] * p_table
    return joint / joint.sum()


def _chi_square_pvalue(first: torch.Tensor, second: torch.Tensor, params: SamplingParams) -> float:
    expected = _exact_two_step(params).ravel() * B
    observed = torch.bincount(first * V + second, minlength=V * V).double().numpy()
    return chi_square_pvalue(observed, expected)


def _pvalue(params: SamplingParams, mode: str, seed: int = 1, **kwargs) -> float:
    first, second = _first_two_committed(params, mode, seed, **kwargs)
    return _chi_square_pvalue(first, second, params)


SETTINGS = {
    "T=1.0": SamplingParams(temperature=1.0),
    "T=0.7": SamplingParams(temperature=0.7),
    "T=1.5": SamplingParams(temperature=1.5),
    "T=1,top_k=3": SamplingParams(temperature=1.0, top_k=3),
    "T=1,top_p=0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "T=1,min_p=0.1": SamplingParams(temperature=1.0, min_p=0.1),
}


def test_toy_lm_is_nontrivial():
    """The draft differs from the target enough that rejections, residuals and second steps matter."""
    params = SETTINGS["T=1.0"]
    p_table, q_table = warp(P_LOGITS, params), warp(Q_LOGITS, params)
    tv = 0.5 * (p_table - q_table).abs().sum(-1)  # [V] total variation per context
    assert tv[X0] > 0.3 and tv.mean() > 0.25
    # the argmax draft is wrong for some contexts and right for others
    agree = P_LOGITS.argmax(-1) == Q_LOGITS.argmax(-1)
    assert agree.any() and not agree.all()
    # truncation leaves zeros in p where q is positive, for the truncated settings
    for name in ("T=1,top_k=3", "T=1,top_p=0.8", "T=1,min_p=0.1"):
        p_trunc = warp(P_LOGITS, SETTINGS[name])
        q_trunc = warp(Q_LOGITS, SETTINGS[name])
        assert ((p_trunc == 0) & (q_trunc > 0)).any(), name


@pytest.mark.parametrize("setting", ["T=1.0", "T=1,top_k=3"])
def test_harness_accepts_plain_target_sampling(setting):
    """Positive control for the harness: (a, b) drawn autoregressively from warp(P) pass."""
    params = SETTINGS[setting]
    p_table = warp(P_LOGITS, params)
    generator = gen(5)
    first = sample(p_table[torch.full((B,), X0, dtype=torch.long)], generator)
    second = sample(p_table[first], generator)
    pvalue = _chi_square_pvalue(first, second, params)
    assert pvalue > P_PASS, f"{setting}: p-value {pvalue:.3g}"


def test_harness_rejects_plain_draft_sampling():
    """...and the same harness rejects pairs whose second token comes from the draft, warp(Q)."""
    params = SETTINGS["T=1.0"]  # no truncation: every pair is possible under the target
    p_table, q_table = warp(P_LOGITS, params), warp(Q_LOGITS, params)
    generator = gen(5)
    first = sample(p_table[torch.full((B,), X0, dtype=torch.long)], generator)
    second = sample(q_table[first], generator)
    pvalue = _chi_square_pvalue(first, second, params)
    assert pvalue < P_REJECT, f"p-value {pvalue:.3g}"


@pytest.mark.parametrize("mode", [SAMPLED, ARGMAX])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_committed_tokens_follow_the_target(setting, mode):
    params = SETTINGS[setting]
    first, second = _first_two_committed(params, mode, seed=1)
    pvalue = _chi_square_pvalue(first, second, params)
    assert pvalue > P_PASS, f"{setting} {mode}: p-value {pvalue:.3g}"


@pytest.mark.parametrize("mode", [SAMPLED, ARGMAX])
def test_bonus_token_follows_the_target(mode):
    """With k = 1 the second committed token is the bonus whenever the draft token is accepted."""
    params = SETTINGS["T=1.0"]
    first, second = _first_two_committed(params, mode, seed=3, k=1)
    pvalue = _chi_square_pvalue(first, second, params)
    assert pvalue > P_PASS, f"k=1 {mode}: p-value {pvalue:.3g}"


def test_negative_control_wrong_q():
    """The draft samples at temperature 1 but the verifier is told q at temperature 0.5."""
    params = SETTINGS["T=1.0"]
    wrong = SamplingParams(temperature=0.5)
    pvalue = _pvalue(params, SAMPLED, told_q_params=wrong)
    assert pvalue < P_REJECT, f"wrong q went unnoticed: p-value {pvalue:.3g}"


def test_negative_control_residual_skipped(monkeypatch):
    """A verifier that draws the recovered token from p itself, not from max(p - q, 0)."""
    calls = []

    def p_unchanged(p, q, draft_tokens):
        calls.append(1)
        return p

    monkeypatch.setattr(verify_module, "residual_distribution", p_unchanged)
    params = SETTINGS["T=1.0"]
    pvalue = _pvalue(params, SAMPLED)
    assert calls, "verify_sampled did not look up the patched residual"
    assert pvalue < P_REJECT, f"skipped residual went unnoticed: p-value {pvalue:.3g}"


def test_negative_control_point_mass_not_removed(monkeypatch):
    """For a deterministic draft, a residual that keeps the rejected token in p."""
    original = verify_module.residual_distribution
    calls = []

    def keeps_draft_token(p, q, draft_tokens):
        calls.append(q is None)
        if q is None:
            return p / p.sum(-1, keepdim=True)
        return original(p, q, draft_tokens)

    monkeypatch.setattr(verify_module, "residual_distribution", keeps_draft_token)
    params = SETTINGS["T=1.0"]
    pvalue = _pvalue(params, ARGMAX)
    assert calls and all(calls)
    assert pvalue < P_REJECT, f"unremoved point mass went unnoticed: p-value {pvalue:.3g}"


def test_sample_draws_each_row_from_its_distribution():
    """`sample` (inverse CDF) follows its rows, unnormalised ones too; the harness rejects a
    neighbouring distribution (negative control), so it can tell."""
    g = gen(11)
    rows = torch.tensor([[0.0, 0.1, 0.0, 0.4, 0.2, 0.3, 0.0],  # zeros first, between and last
                         [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0]])  # unnormalised, mass at both ends
    drawn = sample(rows.repeat_interleave(B, 0), g).view(2, B)  # [2, B]
    for row, tokens in zip(rows, drawn):
        expected = (row.double() / row.double().sum()).numpy() * B
        observed = torch.bincount(tokens, minlength=V).double().numpy()
        assert chi_square_pvalue(observed, expected) > P_PASS
    right = rows[0].double()
    wrong = rows[0].clone()
    wrong[3], wrong[5] = 0.35, 0.35  # 0.05 moved from token 3 to token 5
    observed = torch.bincount(sample(wrong.repeat(B, 1), g), minlength=V).double().numpy()
    assert chi_square_pvalue(observed, (right / right.sum()).numpy() * B) < P_REJECT


def test_sample_never_draws_a_zero_and_reproduces_with_its_seed():
    tiny = torch.zeros(4, 1000)
    tiny[0, 0] = 1e-30  # the only token: the first
    tiny[1, -1] = 1e-30  # the only token: the last
    tiny[2, 500] = 1.0
    tiny[3, ::7] = 1e-3
    for _ in range(200):
        tokens = sample(tiny, gen(_))
        assert (tiny.gather(1, tokens.unsqueeze(1)) > 0).all()
    assert torch.equal(sample(tiny[3:].repeat(50, 1), gen(5)), sample(tiny[3:].repeat(50, 1), gen(5)))
