"""The batch's draft lengths (`goodput.choose_batch_k`): the exact optimum of its cost model, the single-sequence
policy's choice at a batch of one, and speculation that steps aside where a wider pass costs what it earns."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from specdraft.goodput import batch_rate, choose_batch_k
from specdraft.policy import AutoK


def chain_curve(alphas: list[float]) -> list[float]:
    """E[tokens | k] for k = 0..len(alphas): 1 + Σ_{j≤k} Π_{i≤j} α_i."""
    curve, survive = [1.0], 1.0
    for alpha in alphas:
        survive *= alpha
        curve.append(curve[-1] + survive)
    return curve


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_choice_is_the_best_of_every_combination(data):
    batch = data.draw(st.integers(1, 3))
    max_k = data.draw(st.integers(0, 4))
    curves = [chain_curve(data.draw(st.lists(st.floats(0.0, 1.0), min_size=max_k, max_size=max_k)))
              for _ in range(batch)]
    draft_costs = data.draw(st.lists(st.floats(0.0, 0.05), min_size=batch, max_size=batch))
    steps = data.draw(st.lists(st.floats(0.0, 0.05), min_size=batch * (max_k + 1), max_size=batch * (max_k + 1)))
    base = data.draw(st.floats(0.001, 0.1))

    def verify_seconds(width: int) -> float:  # any non-decreasing pass cost
        return base + sum(steps[: width - 1])

    chosen = choose_batch_k(curves, draft_costs, verify_seconds)
    best = max(batch_rate(ks, curves, draft_costs, verify_seconds)
               for ks in itertools.product(range(max_k + 1), repeat=batch))
    assert batch_rate(chosen, curves, draft_costs, verify_seconds) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("alpha, draft_ms, verify_ms", [
    (0.8, 15, [50, 53, 60, 68, 85, 116, 131, 148, 165]),  # a 2-core AVX2 CPU's measured pass costs
    (0.6, 15, [50, 53, 60, 68, 85, 116, 131, 148, 165]),
    (0.9, 2, [100, 101, 102, 103, 104, 105, 106, 107, 108]),  # nearly flat: a GPU
    (0.3, 30, [100, 120, 140, 160, 180, 200, 220, 240, 260]),
])
def test_a_batch_of_one_chooses_what_the_single_sequence_policy_does(alpha, draft_ms, verify_ms):
    policy = AutoK(max_k=8, margin=1.0)
    policy.verify_seconds = [None] + [ms / 1000 for ms in verify_ms]
    est = policy.estimates()
    est.draft_seconds_per_token = draft_ms / 1000
    est.hits, est.tries = [alpha * 100] * 8, [100.0] * 8
    curve = policy.expected_token_curve(8)
    assert choose_batch_k([curve], [draft_ms / 1000], lambda w: verify_ms[w - 1] / 1000) == [policy.choose(8)]


def cpu_pass(width: int) -> float:
    """A pass bound by its weights up to 4 tokens (50 ms, 2 ms a further token), then by compute (15 ms a token)."""
    return 0.050 + 0.002 * min(width - 1, 3) + 0.015 * max(0, width - 4)


def test_speculation_steps_aside_as_the_batch_grows_where_a_wider_pass_costs_compute():
    for batch, drafting in ((1, True), (2, True), (4, False), (8, False), (16, False)):
        ks = choose_batch_k([chain_curve([0.8] * 8)] * batch, [0.015] * batch, cpu_pass, margin=1.05)
        assert any(ks) == drafting, (batch, ks)
    free = choose_batch_k([chain_curve([0.5] * 8)] * 16, [0.0] * 16, cpu_pass)  # prompt lookup, α 0.5: no
    assert free == [0] * 16


def test_where_a_pass_costs_nearly_the_same_for_any_width_every_good_sequence_drafts_long():
    def gpu_pass(width: int) -> float:
        return 0.003 + 0.00002 * width

    curves = [chain_curve([0.9] * 8)] * 12 + [chain_curve([0.05] * 8)] * 4  # four sequences the drafter fails on
    ks = choose_batch_k(curves, [0.0] * 16, gpu_pass)  # prompt lookup: free drafts
    assert all(k >= 6 for k in ks[:12]) and all(k <= 1 for k in ks[12:])


def test_a_batch_with_nothing_to_gain_steps_plain_and_sizes_must_match():
    assert choose_batch_k([], [], cpu_pass) == []
    assert choose_batch_k([[1.0]] * 3, [0.0] * 3, cpu_pass) == [0, 0, 0]  # no drafter: nothing to choose
    with pytest.raises(ValueError, match="one draft cost per sequence"):
        choose_batch_k([[1.0, 1.5]], [], cpu_pass)
