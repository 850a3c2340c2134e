"""The batch's draft lengths (`goodput.choose_batch_k`): the exact optimum of its cost model, the single-sequence
policy's choice at a batch of one, and speculation that steps aside where a wider pass costs what it earns."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from specdraft.goodput import (MAX_RETRY_STEPS, PAUSE_STEPS, REALIZED_STEPS, RETRY_STEPS,
                               RealizedGoodput, batch_rate, choose_batch_k)
from specdraft.policy import AutoK


def per_token(seconds: float, curve: list[float]) -> list[float]:
    """The cost curve of a source that costs `seconds` a draft token and reads nothing first."""
    return [seconds * k for k in range(len(curve))]


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

    max_width = data.draw(st.none() | st.integers(batch, batch * (max_k + 1)))  # a GPU's widest captured pass

    beside = [per_token(c, curve) for c, curve in zip(draft_costs, curves)]
    chosen = choose_batch_k(curves, beside, verify_seconds, max_width=max_width)
    allowed = [ks for ks in itertools.product(range(max_k + 1), repeat=batch)
               if max_width is None or sum(k + 1 for k in ks) <= max_width]
    best = max(batch_rate(ks, curves, beside, verify_seconds) for ks in allowed)
    assert max_width is None or sum(k + 1 for k in chosen) <= max_width
    assert batch_rate(chosen, curves, beside, verify_seconds) == pytest.approx(best, rel=1e-9)


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
    assert choose_batch_k([curve], [per_token(draft_ms / 1000, curve)], lambda w: verify_ms[w - 1] / 1000) == [policy.choose(8)]


@pytest.mark.parametrize("unread, generated, read_ms", [(300, 0, 2.0), (300, 40, 2.0), (40, 5, 0.5), (0, 10, 2.0)])
def test_a_batch_of_one_prices_a_catch_up_as_the_single_sequence_policy_does(unread, generated, read_ms):
    policy = AutoK(max_k=8)
    policy.verify_seconds = [None] + [ms / 1000 for ms in (50, 53, 60, 68, 85, 116, 131, 148, 165)]
    est = policy.estimates()
    est.draft_seconds_per_token, est.read_seconds_per_token = 0.012, read_ms / 1000
    est.hits, est.tries = [85.0] * 8, [100.0] * 8
    left = policy.expected_left(generated, 100)
    curve = policy.expected_token_curve(8)
    beside = policy.draft_cost_curve(8, unread=unread, left=left, curve=curve)
    alone = policy.choose(8, unread=unread, remaining=100, generated=generated)
    assert choose_batch_k([curve], [beside], policy.verify_estimate, margin=policy.margin) == [alone]


def cpu_pass(width: int) -> float:
    """A pass bound by its weights up to 4 tokens (50 ms, 2 ms a further token), then by compute (15 ms a token)."""
    return 0.050 + 0.002 * min(width - 1, 3) + 0.015 * max(0, width - 4)


def test_speculation_steps_aside_as_the_batch_grows_where_a_wider_pass_costs_compute():
    for batch, drafting in ((1, True), (2, True), (4, False), (8, False), (16, False)):
        curve = chain_curve([0.8] * 8)
        ks = choose_batch_k([curve] * batch, [per_token(0.015, curve)] * batch, cpu_pass, margin=1.05)
        assert any(ks) == drafting, (batch, ks)
    curve = chain_curve([0.5] * 8)
    free = choose_batch_k([curve] * 16, [per_token(0.0, curve)] * 16, cpu_pass)  # prompt lookup, α 0.5: no
    assert free == [0] * 16


def test_where_a_pass_costs_nearly_the_same_for_any_width_every_good_sequence_drafts_long():
    def gpu_pass(width: int) -> float:
        return 0.003 + 0.00002 * width

    curves = [chain_curve([0.9] * 8)] * 12 + [chain_curve([0.05] * 8)] * 4  # four sequences the drafter fails on
    ks = choose_batch_k(curves, [per_token(0.0, curve) for curve in curves], gpu_pass)  # prompt lookup: free drafts
    assert all(k >= 6 for k in ks[:12]) and all(k <= 1 for k in ks[12:])


def test_a_batch_on_a_gpu_stays_within_its_widest_captured_pass():
    """Flat passes up to 64 tokens, an estimate that knows nothing of the eager pass beyond: the widest-graph bound
    keeps 16 good sequences to 64 tokens in all (3 draft tokens each), where unbounded they would draft more."""
    def gpu_pass(width: int) -> float:
        return 0.002 + 0.00001 * width

    curves = [chain_curve([0.8] * 8)] * 16
    beside = [per_token(0.0, curve) for curve in curves]
    assert sum(k + 1 for k in choose_batch_k(curves, beside, gpu_pass)) > 64  # unbounded: past the widest graph
    assert choose_batch_k(curves, beside, gpu_pass, max_width=64) == [3] * 16
    assert choose_batch_k(curves, beside, gpu_pass, max_width=16) == [0] * 16  # no room: plain


def test_a_batch_with_nothing_to_gain_steps_plain_and_sizes_must_match():
    assert choose_batch_k([], [], cpu_pass) == []
    assert choose_batch_k([[1.0]] * 3, [[0.0]] * 3, cpu_pass) == [0, 0, 0]  # no drafter: nothing to choose
    with pytest.raises(ValueError, match="one cost curve per sequence"):
        choose_batch_k([[1.0, 1.5]], [], cpu_pass)
    with pytest.raises(ValueError, match="as long as its token curve"):
        choose_batch_k([[1.0, 1.5]], [[0.0]], cpu_pass)


def test_realized_rates_stop_drafting_where_it_gave_less_and_try_again_later():
    realized = RealizedGoodput()
    for _ in range(REALIZED_STEPS - 1):
        realized.record(2, False, 2, 0.05)  # plain: 40 tokens/s
        realized.record(2, True, 3, 0.10)  # drafting: 30 tokens/s
    assert realized.drafting_pays(2)  # too few steps of each kind to judge
    realized.record(2, False, 2, 0.05)
    realized.record(2, True, 3, 0.10)
    assert not realized.drafting_pays(2) and not realized.allows_drafting(2)
    assert realized.allows_drafting(3) and realized.allows_drafting(1)  # each batch size is judged alone
    for _ in range(RETRY_STEPS - 1):
        realized.record(2, False, 2, 0.05)
    assert not realized.allows_drafting(2)
    realized.record(2, False, 2, 0.05)
    assert realized.allows_drafting(2)  # one try, which counts more than the old drafting steps, decayed
    realized.record(2, True, 6, 0.10)  # 60 tokens/s this time
    assert realized.drafting_pays(2)


def _plain_steps_until_a_try(realized: RealizedGoodput, size: int) -> int:
    """Plain steps (40 tokens/s) recorded at `size` until drafting may be tried there."""
    waited = 0
    while not realized.allows_drafting(size):
        realized.record(size, False, 2, 0.05)
        waited += 1
    return waited


def test_each_try_that_loses_doubles_the_wait_and_a_try_that_pays_resets_it():
    realized = RealizedGoodput()
    for _ in range(REALIZED_STEPS):
        realized.record(4, False, 2, 0.05)  # plain: 40 tokens/s
        realized.record(4, True, 1, 0.10)  # drafting: 10 tokens/s
    waits = []
    for _ in range(6):
        waits.append(_plain_steps_until_a_try(realized, 4))
        realized.record(4, True, 1, 0.10)  # the try loses
    assert waits == [RETRY_STEPS, 2 * RETRY_STEPS, 4 * RETRY_STEPS, MAX_RETRY_STEPS, MAX_RETRY_STEPS, MAX_RETRY_STEPS]
    assert _plain_steps_until_a_try(realized, 4) == MAX_RETRY_STEPS
    realized.record(4, True, 12, 0.10)  # this try pays: 120 tokens/s
    assert realized.drafting_pays(4)
    for _ in range(3):
        realized.record(4, True, 1, 0.10)  # and then drafting loses again
    assert not realized.drafting_pays(4)
    assert _plain_steps_until_a_try(realized, 4) == RETRY_STEPS  # the wait starts over


def _paused_steps(realized: RealizedGoodput, size: int) -> int:
    """Plain steps a batch size takes before it may ask again."""
    steps = 0
    while not realized.allows_drafting(size):
        realized.record(size, False, size, 0.01)
        steps += 1
    return steps


def test_a_decline_pauses_the_asking_at_its_batch_size():
    realized = RealizedGoodput()
    assert realized.allows_drafting(4)
    for _ in range(3):
        realized.declined(4)
        assert not realized.allows_drafting(4) and realized.allows_drafting(2) and realized.allows_drafting(8)
        assert _paused_steps(realized, 4) == PAUSE_STEPS
    realized.declined(4)
    realized.record(4, True, 8, 0.01)  # a step that drafted (a fixed k) leaves the pause as it was
    assert _paused_steps(realized, 4) == PAUSE_STEPS
