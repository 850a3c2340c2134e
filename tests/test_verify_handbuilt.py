"""Tier 1 of the exactness tests (docs/design.md): hand-built logits whose verdict is known.

Every case here has an answer that can be worked out by hand: which draft tokens the
verifier keeps, which token comes next, what the residual distribution is, and what
`warp` turns a row of logits into.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    seen_tokens_per_row,
    warp,
)
from specdraft.verify import residual_distribution, verify_greedy, verify_greedy_chains, verify_sampled
from seeded import gen

V = 6


def one_hot_logits(argmaxes: list[int], vocab: int = V) -> torch.Tensor:
    """Logits `[len(argmaxes), vocab]` whose row i has its unique maximum at argmaxes[i]."""
    rows = torch.arange(vocab, dtype=torch.float32).repeat(len(argmaxes), 1) * 0.1  # small slope, no ties
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


def probs(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    assert math.isclose(float(t.sum()), 1.0, abs_tol=1e-6)
    return t


# ---------------------------------------------------------------------------------------------
# verify_greedy
# ---------------------------------------------------------------------------------------------


def test_greedy_rejects_at_first_position():
    draft = torch.tensor([[1, 2, 3]])
    logits = one_hot_logits([4, 2, 3, 5]).unsqueeze(0)  # position 0 wants 4, not 1
    verdict = verify_greedy(draft, logits)
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.next_token.tolist() == [4]


def test_greedy_partial_acceptance_ignores_later_matches():
    draft = torch.tensor([[1, 2, 3, 0]])
    # positions 0, 1 match; 2 mismatches (wants 5); 3 would match but comes after a rejection
    logits = one_hot_logits([1, 2, 5, 0, 4]).unsqueeze(0)
    verdict = verify_greedy(draft, logits)
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.next_token.tolist() == [5]


def test_greedy_full_acceptance_gives_bonus_argmax_of_last_row():
    draft = torch.tensor([[1, 2, 3]])
    logits = one_hot_logits([1, 2, 3, 5]).unsqueeze(0)
    verdict = verify_greedy(draft, logits)
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.next_token.tolist() == [5]


def test_greedy_accepts_probabilities_as_well_as_logits():
    draft = torch.tensor([[1, 2]])
    logits = one_hot_logits([1, 0, 4]).unsqueeze(0)
    p = logits.softmax(-1)
    for scores in (logits, p):
        verdict = verify_greedy(draft, scores)
        assert verdict.num_accepted.tolist() == [1]
        assert verdict.next_token.tolist() == [0]


def test_greedy_batched_rows_with_different_outcomes():
    draft = torch.tensor(
        [
            [1, 2, 3],  # rejected at 0
            [1, 2, 3],  # accepted 1
            [1, 2, 3],  # accepted 2
            [1, 2, 3],  # all accepted, bonus
            [4, 4, 4],  # rejected at 0, later positions would match
        ]
    )
    logits = torch.stack(
        [
            one_hot_logits([0, 2, 3, 5]),
            one_hot_logits([1, 5, 3, 5]),
            one_hot_logits([1, 2, 0, 5]),
            one_hot_logits([1, 2, 3, 4]),
            one_hot_logits([3, 4, 4, 4]),
        ]
    )
    verdict = verify_greedy(draft, logits)
    assert verdict.num_accepted.tolist() == [0, 1, 2, 3, 0]
    assert verdict.next_token.tolist() == [0, 5, 0, 4, 3]
    assert verdict.num_accepted.dtype == torch.int64
    assert verdict.next_token.dtype == torch.int64


def test_greedy_chains_of_different_lengths_at_once_match_each_alone():
    """A batch's greedy chains, ragged ([3], [0], [2], [1] tokens), in one verdict: each row is its chain's
    `verify_greedy` alone, a short chain accepting at most its own tokens (its padding matches nothing)."""
    chains = [([1, 2, 3], [1, 2, 3, 4]), ([], [5]), ([4, 4], [4, 4, 0]), ([2], [3, 2])]
    drafts = [torch.tensor(tokens, dtype=torch.long) for tokens, _ in chains]
    choices = [one_hot_logits(argmaxes).argmax(-1) for _, argmaxes in chains]
    verdict = verify_greedy_chains(drafts, choices)
    alone = [verify_greedy(d.unsqueeze(0), one_hot_logits(a).unsqueeze(0)) for d, (_, a) in zip(drafts, chains)]
    assert verdict.num_accepted.tolist() == [int(v.num_accepted) for v in alone] == [3, 0, 2, 0]
    assert verdict.next_token.tolist() == [int(v.next_token) for v in alone] == [4, 5, 0, 3]
    assert verdict.deepest().tolist() == [2, -1, 1, -1]


# ---------------------------------------------------------------------------------------------
# residual_distribution
# ---------------------------------------------------------------------------------------------


def test_residual_worked_example():
    p = probs([0.5, 0.3, 0.2, 0.0])
    q = probs([0.2, 0.5, 0.1, 0.2])
    # max(p - q, 0) = [0.3, 0, 0.1, 0] -> normalised [0.75, 0, 0.25, 0]
    res = residual_distribution(p.view(1, 1, 4), q.view(1, 1, 4), torch.tensor([[1]]))
    assert res.shape == (1, 1, 4)
    torch.testing.assert_close(res[0, 0], torch.tensor([0.75, 0.0, 0.25, 0.0]))


def test_residual_point_mass_removes_the_draft_token():
    p = probs([0.5, 0.3, 0.2, 0.0])
    res = residual_distribution(p.view(1, 1, 4), None, torch.tensor([[0]]))
    torch.testing.assert_close(res[0, 0], torch.tensor([0.0, 0.6, 0.4, 0.0]))
    res = residual_distribution(p.view(1, 1, 4), None, torch.tensor([[2]]))
    torch.testing.assert_close(res[0, 0], torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))


def test_residual_is_per_position_and_per_row():
    p = torch.stack(
        [
            torch.stack([probs([0.5, 0.5, 0.0]), probs([0.1, 0.1, 0.8])]),
            torch.stack([probs([1.0, 0.0, 0.0]), probs([0.2, 0.2, 0.6])]),
        ]
    )  # [2, 2, 3]
    q = torch.stack(
        [
            torch.stack([probs([0.25, 0.25, 0.5]), probs([0.1, 0.8, 0.1])]),
            torch.stack([probs([0.0, 0.5, 0.5]), probs([0.2, 0.2, 0.6])]),
        ]
    )
    res = residual_distribution(p, q, torch.zeros(2, 2, dtype=torch.long))
    expected = torch.tensor(
        [
            [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]],
            [[1.0, 0.0, 0.0], [0.2, 0.2, 0.6]],  # last: p == q -> falls back to p
        ]
    )
    torch.testing.assert_close(res, expected)


def test_residual_falls_back_to_p_when_empty():
    p = probs([0.1, 0.2, 0.3, 0.4])
    res = residual_distribution(p.view(1, 1, 4), p.view(1, 1, 4).clone(), torch.tensor([[3]]))
    assert torch.isfinite(res).all()
    torch.testing.assert_close(res[0, 0], p)
    # q dominating p everywhere p lives (p a point mass inside q's support) is also empty
    p1 = probs([0.0, 1.0, 0.0, 0.0])
    res = residual_distribution(p1.view(1, 1, 4), None, torch.tensor([[1]]))
    torch.testing.assert_close(res[0, 0], p1)


def test_residual_with_q_zero_where_p_positive_is_finite():
    p = probs([0.4, 0.6, 0.0])
    q = probs([0.0, 0.5, 0.5])
    res = residual_distribution(p.view(1, 1, 3), q.view(1, 1, 3), torch.tensor([[0]]))
    assert torch.isfinite(res).all()
    # max(p - q, 0) = [0.4, 0.1, 0] -> [0.8, 0.2, 0]
    torch.testing.assert_close(res[0, 0], torch.tensor([0.8, 0.2, 0.0]))


# ---------------------------------------------------------------------------------------------
# verify_sampled
# ---------------------------------------------------------------------------------------------

N_ROWS = 2000


def batch(row: torch.Tensor, n: int = N_ROWS) -> torch.Tensor:
    return row.unsqueeze(0).expand(n, *row.shape).contiguous()


def test_sampled_draft_token_with_p_zero_is_always_rejected():
    p0 = probs([0.5, 0.0, 0.3, 0.2])
    q0 = probs([0.1, 0.7, 0.1, 0.1])  # the draft likes token 1, the target never emits it
    p_bonus = probs([0.25, 0.25, 0.25, 0.25])
    p = batch(torch.stack([p0, p_bonus]))  # [N, 2, 4]
    q = batch(q0.view(1, 4))
    draft = torch.full((N_ROWS, 1), 1)
    for seed in range(5):
        verdict = verify_sampled(draft, q, p, gen(seed))
        assert (verdict.num_accepted == 0).all()
        # recovered from normalize(max(p - q, 0)) = normalize([0.4, 0, 0.2, 0.1])
        assert set(verdict.next_token.tolist()) <= {0, 2, 3}
        assert set(verdict.next_token.tolist()) == {0, 2, 3}  # all three really occur in 2000 draws
    # the same with a deterministic proposal
    verdict = verify_sampled(draft, None, p, gen(99))
    assert (verdict.num_accepted == 0).all()
    assert 1 not in verdict.next_token.tolist()


def test_sampled_q_equal_p_accepts_everything():
    rows = torch.stack(
        [
            probs([0.9, 0.05, 0.05, 0.0]),
            probs([0.01, 0.01, 0.01, 0.97]),
            probs([0.25, 0.25, 0.25, 0.25]),
        ]
    )
    bonus = probs([0.0, 0.0, 0.5, 0.5])
    p = batch(torch.cat([rows, bonus.view(1, 4)]))  # [N, 4, 4]
    q = batch(rows.clone())
    draft_gen = gen(1234)
    for seed in range(20):
        # draft tokens drawn from q (so also the unlikely ones, 0.01, come up)
        draft = torch.multinomial(q.reshape(-1, 4), 1, generator=draft_gen).view(N_ROWS, 3)
        verdict = verify_sampled(draft, q, p, gen(seed))
        assert (verdict.num_accepted == 3).all()
        assert set(verdict.next_token.tolist()) <= {2, 3}  # the bonus comes from the last row


def test_sampled_q_zero_where_p_positive_is_accepted_without_nan():
    p0 = probs([0.4, 0.6, 0.0])
    q0 = probs([0.0, 0.5, 0.5])
    bonus = probs([0.0, 0.0, 1.0])
    p = batch(torch.stack([p0, bonus]))
    q = batch(q0.view(1, 3))
    draft = torch.zeros(N_ROWS, 1, dtype=torch.long)  # q(0) = 0 < p(0) = 0.4: ratio is +inf -> accept
    for seed in range(5):
        verdict = verify_sampled(draft, q, p, gen(seed))
        assert (verdict.num_accepted == 1).all()
        assert (verdict.next_token == 2).all()


def test_sampled_point_mass_recovery_never_repeats_the_rejected_token():
    p0 = probs([0.5, 0.2, 0.2, 0.1])
    bonus = probs([0.25, 0.25, 0.25, 0.25])
    p = batch(torch.stack([p0, bonus]))
    draft = torch.zeros(N_ROWS, 1, dtype=torch.long)
    total_rejected = 0
    for seed in range(10):
        verdict = verify_sampled(draft, None, p, gen(seed))
        rejected = verdict.num_accepted == 0
        total_rejected += int(rejected.sum())
        assert not (verdict.next_token[rejected] == 0).any()
        # accepted with probability p(0) = 0.5: 2000 draws, 6 sigma ~ 134
        assert abs(int(rejected.sum()) - N_ROWS // 2) < 134
    assert total_rejected > 0


def test_sampled_worked_example_accept_reject_accept_gives_one():
    # mask [1, 0, 1] -> num_accepted 1, next token = recovered token of position 1
    p = torch.stack(
        [
            probs([0.0, 1.0, 0.0, 0.0]),  # draft 1: p = q = 1 -> always accepted
            probs([0.0, 0.0, 0.0, 1.0]),  # draft 2: p = 0 -> always rejected, residual = [0, 0, 0, 1]
            probs([0.0, 0.0, 1.0, 0.0]),  # draft 2 again: would be accepted
            probs([1.0, 0.0, 0.0, 0.0]),  # bonus row
        ]
    )
    q = torch.stack([probs([0.0, 1.0, 0.0, 0.0]), probs([0.0, 0.0, 1.0, 0.0]), probs([0.0, 0.0, 1.0, 0.0])])
    draft = torch.tensor([1, 2, 2])
    verdict = verify_sampled(batch(draft, 50), batch(q, 50), batch(p, 50), gen(7))
    assert (verdict.num_accepted == 1).all()
    assert (verdict.next_token == 3).all()


def test_sampled_batched_rows_with_different_outcomes():
    always = probs([0.0, 1.0, 0.0])  # p(1) = 1
    never = probs([0.5, 0.0, 0.5])  # p(1) = 0
    bonus = probs([0.0, 0.0, 1.0])
    q_row = probs([0.2, 0.6, 0.2])
    p = torch.stack(
        [
            torch.stack([never, always, bonus]),  # 0 accepted
            torch.stack([always, never, bonus]),  # 1 accepted
            torch.stack([always, always, bonus]),  # 2 accepted, bonus 2
        ]
    )
    q = batch(torch.stack([q_row, q_row]), 3)
    draft = torch.ones(3, 2, dtype=torch.long)
    for seed in range(10):
        verdict = verify_sampled(draft, q, p, gen(seed))
        assert verdict.num_accepted.tolist() == [0, 1, 2]
        assert verdict.next_token[2].item() == 2
        # recovered from normalize(max(never - q, 0)) = normalize([0.3, 0, 0.3]): never token 1
        assert verdict.next_token[0].item() in (0, 2)
        assert verdict.next_token[1].item() in (0, 2)


def test_sampled_is_reproducible_with_the_same_generator_seed():
    logits = torch.randn(500, 3, V, generator=gen(5))
    q = logits.softmax(-1)
    p = torch.randn(500, 4, V, generator=gen(6)).softmax(-1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=gen(8)).view(500, 3)
    a = verify_sampled(draft, q, p, gen(11))
    b = verify_sampled(draft, q, p, gen(11))
    c = verify_sampled(draft, q, p, gen(12))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert not (torch.equal(a.num_accepted, c.num_accepted) and torch.equal(a.next_token, c.next_token))


@pytest.mark.parametrize(
    "target_params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=0.8, top_k=2),
        SamplingParams(temperature=1.0, min_p=0.5),
    ],
    ids=["top_k=1", "top_p=0.3", "top_k=2", "min_p=0.5"],
)
def test_sampled_truncation_rejects_drafts_outside_target_support(target_params):
    k, n = 2, 4000
    g = gen(21)
    target_logits = torch.tensor(
        [
            [2.0, 0.5, 1.0, -0.5, 0.2, 1.4],
            [0.1, 2.5, -0.3, 1.9, 0.0, 0.7],
            [1.1, 0.4, 0.9, 0.3, 2.2, -1.0],
        ]
    )
    p_row = warp(target_logits, target_params)  # [k + 1, V], zeros outside the truncated support
    support = p_row > 0
    assert (~support).any(dim=-1).all(), "truncation must leave zeros in every row"
    q_row = warp(torch.zeros(k, V), SamplingParams(temperature=1.0))  # uniform draft: q > 0 everywhere
    p = batch(p_row, n)
    q = batch(q_row, n)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(n, k)
    verdict = verify_sampled(draft, q, p, gen(22))
    num = verdict.num_accepted
    pos = torch.arange(k)
    in_support = support[pos, draft]  # [n, k]
    # a draft token where p = 0 is rejected: num_accepted never passes the first such position
    first_outside = torch.where(in_support.all(-1), k, (~in_support).long().argmax(-1))
    assert (num <= first_outside).all()
    assert (num[first_outside == 0] == 0).all()
    assert (first_outside == 0).any() and (first_outside > 0).any()
    # whatever comes next (recovered or bonus) lies in p's support at that position
    assert support[num, verdict.next_token].all()
    # accepted tokens are all inside the support too
    accepted_positions = pos.unsqueeze(0) < num.unsqueeze(1)
    assert in_support[accepted_positions].all()


def test_sampled_top_k_one_recovers_exactly_the_target_argmax():
    target_logits = torch.tensor([[0.3, 2.0, 0.1, -1.0, 0.4, 0.0], [1.5, 0.0, 0.2, 0.1, -0.5, 0.3]])
    p_row = warp(target_logits, SamplingParams(temperature=1.0, top_k=1))
    torch.testing.assert_close(p_row, torch.nn.functional.one_hot(torch.tensor([1, 0]), V).float())
    q_row = warp(torch.zeros(1, V), SamplingParams(temperature=1.0))
    n = 600
    draft = torch.arange(n).remainder(V).view(n, 1)  # every token proposed 100 times
    verdict = verify_sampled(draft, batch(q_row, n), batch(p_row, n), gen(3))
    hit = draft[:, 0] == 1
    assert (verdict.num_accepted[hit] == 1).all() and (verdict.next_token[hit] == 0).all()
    assert (verdict.num_accepted[~hit] == 0).all() and (verdict.next_token[~hit] == 1).all()


# ---------------------------------------------------------------------------------------------
# sampling.warp
# ---------------------------------------------------------------------------------------------

LOGITS = torch.tensor([[1.0, -0.5, 2.5, 0.3, -2.0, 1.7], [0.0, 0.4, -1.2, 3.0, 0.9, -0.1]])


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5, 4.0])
def test_warp_temperature_is_softmax_of_scaled_logits(temperature):
    out = warp(LOGITS, SamplingParams(temperature=temperature))
    assert out.dtype == torch.float32
    expected = torch.softmax(LOGITS.double() / temperature, -1).float()
    torch.testing.assert_close(out, expected)


def test_warp_upcasts_half_logits_to_float32():
    out = warp(LOGITS.half(), SamplingParams(temperature=1.0))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, LOGITS.half().float().softmax(-1))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_warp_top_k_keeps_exactly_k_tokens(k):
    out = warp(LOGITS, SamplingParams(temperature=0.9, top_k=k))
    for row, logits in zip(out, LOGITS):
        kept = (row > 0).nonzero().flatten()
        assert len(kept) == k
        top = torch.topk(logits, k).indices
        assert set(kept.tolist()) == set(top.tolist())
        expected = torch.zeros(V)
        expected[top] = torch.softmax(logits[top] / 0.9, -1)
        torch.testing.assert_close(row, expected)


def test_warp_top_k_at_or_above_vocab_is_off():
    plain = warp(LOGITS, SamplingParams(temperature=1.0))
    torch.testing.assert_close(warp(LOGITS, SamplingParams(temperature=1.0, top_k=V)), plain)
    torch.testing.assert_close(warp(LOGITS, SamplingParams(temperature=1.0, top_k=V + 10)), plain)


# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 placed out of order
TOP_P_PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
TOP_P_LOGITS = TOP_P_PROBS.log().view(1, -1)


def _assert_renormalised_subset(out, kept):
    """`out` keeps exactly the tokens `kept`, with TOP_P_PROBS renormalised over them."""
    assert set((out > 0).nonzero().flatten().tolist()) == kept
    idx = torch.tensor(sorted(kept))
    expected = torch.zeros(5)
    expected[idx] = TOP_P_PROBS[idx] / TOP_P_PROBS[idx].sum()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.2, {1}),  # 0.4 alone reaches 0.2
        (0.39, {1}),
        (0.45, {1, 3}),  # 0.4 < 0.45 <= 0.7
        (0.69, {1, 3}),
        (0.72, {1, 3, 4}),  # 0.7 < 0.72 <= 0.85
        (0.9, {1, 3, 4, 0}),  # 0.85 < 0.9 <= 0.95
        (0.97, {0, 1, 2, 3, 4}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_warp_top_p_keeps_smallest_prefix_reaching_top_p(top_p, kept):
    out = warp(TOP_P_LOGITS, SamplingParams(temperature=1.0, top_p=top_p))[0]
    _assert_renormalised_subset(out, kept)


def test_warp_top_p_applies_after_temperature():
    # at temperature 0.5 the probabilities sharpen to 0.4^2 : 0.3^2 : ... -> top one is 0.16/0.285 = 0.561
    sharp = TOP_P_PROBS**2 / (TOP_P_PROBS**2).sum()
    assert 0.55 < float(sharp.max()) < 0.57
    out = warp(TOP_P_LOGITS, SamplingParams(temperature=0.5, top_p=0.55))[0]
    assert (out > 0).nonzero().flatten().tolist() == [1]
    torch.testing.assert_close(out[1], torch.tensor(1.0))
    out = warp(TOP_P_LOGITS, SamplingParams(temperature=1.0, top_p=0.55))[0]
    assert set((out > 0).nonzero().flatten().tolist()) == {1, 3}


@pytest.mark.parametrize(
    "min_p, kept",
    [
        (0.2, {0, 1, 3, 4}),  # threshold 0.08: drops 0.05
        (0.3, {1, 3, 4}),  # threshold 0.12: drops 0.1, 0.05
        (0.5, {1, 3}),  # threshold 0.2
        (0.9, {1}),  # threshold 0.36
        (1.0, {1}),
    ],
)
def test_warp_min_p(min_p, kept):
    out = warp(TOP_P_LOGITS, SamplingParams(temperature=1.0, min_p=min_p))[0]
    _assert_renormalised_subset(out, kept)


def test_apply_repetition_penalty_only_touches_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.0], [2.0, -1.0, 3.0, -2.0, 0.0]])
    seen = torch.tensor([[True, False, False, True, True], [False, True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    expected = torch.tensor([[1.0, -1.0, 3.0, -4.0, 0.0], [2.0, -2.0, 1.5, -2.0, 0.0]])
    torch.testing.assert_close(out, expected)
    # penalty 1 is off
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.0), logits)
    # a penalty below 1 encourages seen tokens: positive up, negative toward 0
    out = apply_repetition_penalty(logits, seen, 0.5)
    torch.testing.assert_close(out[0], torch.tensor([4.0, -1.0, 3.0, -1.0, 0.0]))


def test_warp_repetition_penalty_then_temperature():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0]])
    seen = torch.tensor([[True, False, False, True]])
    out = warp(logits, SamplingParams(temperature=0.5, repetition_penalty=2.0), seen)
    penalised = torch.tensor([[1.0, -1.0, 3.0, -4.0]])
    torch.testing.assert_close(out, (penalised / 0.5).softmax(-1))


def test_warp_repetition_penalty_needs_seen():
    with pytest.raises(ValueError):
        warp(LOGITS, SamplingParams(temperature=1.0, repetition_penalty=1.3))


def test_warp_greedy_is_one_hot_on_argmax():
    out = warp(LOGITS, SamplingParams(temperature=0.0))
    torch.testing.assert_close(out, torch.nn.functional.one_hot(torch.tensor([2, 3]), V).float())


def test_warp_greedy_uses_the_penalised_argmax():
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0], [3.0, 2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, False, False, False], [False, False, False, False]])
    out = warp(logits, SamplingParams(temperature=0.0, repetition_penalty=2.0), seen)
    # row 0: 3 / 2 = 1.5 < 2 -> argmax moves to token 1; row 1 unchanged
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_seen_tokens_per_row_worked_example():
    a, b, c, d, e = range(5)
    context = torch.zeros(5, dtype=torch.bool)
    context[a] = True
    rows = seen_tokens_per_row(context, torch.tensor([b, c]))
    assert rows.dtype == torch.bool
    assert rows.tolist() == [
        [True, True, False, False, False],  # {a, b}
        [True, True, True, False, False],  # {a, b, c}
    ]
    # a repeated token and a token already in the context
    rows = seen_tokens_per_row(context, torch.tensor([a, d, d, e]))
    assert rows.tolist() == [
        [True, False, False, False, False],
        [True, False, False, True, False],
        [True, False, False, True, False],
        [True, False, False, True, True],
    ]
    assert not context[[b, c, d, e]].any(), "the context mask is not modified"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.01},
        {"top_k": -1},
        {"min_p": -0.01},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("nan")},
    ],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(SpecdraftError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 2.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"repetition_penalty": 0.5},
        {"top_k": 50},
    ],
)
def test_sampling_params_accept_edge_values(kwargs):
    params = SamplingParams(**kwargs)
    assert params.greedy == (params.temperature == 0.0)


@pytest.mark.parametrize("bad", [dict(temperature=1e-40), dict(top_k=2.5)])
def test_sampling_params_reject_values_that_break_warping(bad):
    with pytest.raises(SpecdraftError):
        SamplingParams(**bad)
