"""The k policy: a fixed k, and `auto` (cost model + online acceptance) — choices and exactness."""

import pytest

from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder
from specdraft.errors import SpecdraftError
from specdraft.policy import (ANSWER_FLOOR, DEFAULT_SOURCE, GPU_MAX_AUTO_K, MAX_AUTO_K, READ_SAMPLE_MIN, SPIKE, STALE_STEPS,
                              AutoK, FixedK, StepCosts, make_policy)

PROMPT = [5, 17, 42, 8, 59, 3]


def calibrated(verify_ms: list[float], draft_ms: float, alpha: float, max_k: int = 6) -> AutoK:
    """An AutoK with given pass costs (index = tokens per pass) and a settled acceptance estimate."""
    policy = AutoK(max_k=max_k)
    policy.verify_seconds = [None] + [None if ms is None else ms / 1000 for ms in verify_ms]
    est = policy.estimates()
    est.draft_seconds_per_token = draft_ms / 1000
    est.hits = [alpha * 1000] * max_k
    est.tries = [1000.0] * max_k
    return policy


def test_make_policy_reads_auto_and_integers():
    assert isinstance(make_policy("auto"), AutoK) and isinstance(make_policy(" AUTO "), AutoK)
    assert make_policy("4").k == 4 and make_policy(3).k == 3
    for bad in ("0", "-2", "many", 0, 2.5, True):
        with pytest.raises(SpecdraftError, match="must be an integer >= 1 or 'auto'"):
            make_policy(bad)


def test_fixed_k_respects_the_limit():
    assert FixedK(5).choose(10) == 5 and FixedK(5).choose(2) == 2 and FixedK(5).choose(0) == 0


def test_expected_tokens_is_the_geometric_sum():
    policy = calibrated([100] * 7, 10, alpha=0.5)
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125, rel=1e-3)


def test_flat_verify_cost_and_good_acceptance_draft_long():
    policy = calibrated([100, 101, 102, 103, 104, 105, 106], draft_ms=2, alpha=0.9)
    assert policy.choose(10) == 6


def test_steep_verify_cost_limits_k():
    """A pass that gets dear past 4 tokens (the CPU int4 kernel) keeps k at 3."""
    policy = calibrated([100, 105, 110, 115, 250, 260, 270], draft_ms=10, alpha=0.8)
    assert policy.choose(10) == 3


def test_poor_acceptance_falls_back_to_plain_decoding_and_probes_less_often():
    policy = calibrated([100, 120, 140, 160, 180, 200, 220], draft_ms=30, alpha=0.1)
    waits = []
    for _ in range(4):
        choices = []
        while not choices or choices[-1] == 0:
            choices.append(policy.choose(10))
            policy.observe(choices[-1], 0, draft_seconds=0.03 * choices[-1], verify_seconds=0.1)  # probes fail
        assert choices[-1] == 1  # a probe (the k the cost model ranks first), so the estimate can recover
        waits.append(len(choices))
    assert waits == [9, 17, 33, 65]  # 8 plain steps, then 16, 32, 64 (the cap)
    policy.begin_request()  # a new prompt probes sooner, but not as soon as a fresh drafter
    assert policy.estimates().probe_interval == 32
    for _ in range(3):
        policy.begin_request()
    assert policy.estimates().probe_interval == policy.probe_every


def test_a_probe_resets_the_wait_only_when_drafting_pays_again():
    """The same probe (one token of two accepted) resets the wait to `probe_every` where it makes drafting pay
    again (a drafter with little evidence against it), and doubles it where it does not (one settled near
    α 0.1: one token in a text the drafter suits poorly is no recovery); nothing accepted always doubles it."""
    def probe(policy, accepted: int) -> int:
        while policy.choose(10) == 0:
            policy.observe(0, 0, draft_seconds=0.0, verify_seconds=0.1)
        policy.observe(2, accepted, draft_seconds=0.05, verify_seconds=0.12)
        return policy.estimates().probe_interval

    settled = calibrated([100, 110, 120, 130, 140, 150, 160], draft_ms=25, alpha=0.1)
    assert [probe(settled, accepted) for accepted in (0, 1, 2)] == [16, 32, 64]
    unsure = calibrated([100, 110, 120, 130, 140, 150, 160], draft_ms=25, alpha=0.3)
    est = unsure.estimates()
    est.hits, est.tries = [0.6] * 6, [2.0] * 6  # α 0.3 on little evidence: drafting does not pay yet
    assert not unsure.drafting_pays()
    assert probe(unsure, 1) == unsure.probe_every and unsure.drafting_pays()


def test_a_pass_timed_once_at_a_slow_moment_does_not_keep_drafting_out():
    """Seen in a fresh process (AVX2, a code prompt, the timings below): the first 2-token pass was timed at a slow
    moment (27.7 ms), then the host sped up and plain steps kept the one-token pass at 22 ms; 1.26x priced drafting
    out, and the probes (2 tokens: a 3-token pass) never timed 2 tokens again: 5 drafts in 98 steps, 10% slower than
    the runs that drafted. A probe drafts the k the cost model ranks first, so the pass it would run is timed
    anew, and an estimate that rests on one timing takes the next at half weight."""
    policy = AutoK(max_k=3)
    assert policy.choose(3) == 3  # nothing timed: the first draft
    policy.observe(3, 3, draft_seconds=0.066, verify_seconds=0.0425, unread=16)  # a draft model's first read too
    assert policy.choose(3) >= 1
    policy.observe(1, 0, draft_seconds=0.0089, verify_seconds=0.0277)  # the slow moment
    choices = []
    while not choices or choices[-1] == 0:
        choices.append(policy.choose(3))
        if choices[-1] == 0:
            policy.observe(0, 0, draft_seconds=0.0, verify_seconds=0.022)  # the host sped up
    assert len(choices) == policy.probe_every + 1 and choices[-1] == 1  # plain steps, then a one-token probe
    policy.observe(1, 1, draft_seconds=0.0089, verify_seconds=0.0236)  # its pass, timed where the host is now
    assert policy.verify_estimate(2) == pytest.approx((0.0277 + 0.0236) / 2)
    assert policy.choose(3) > 0  # drafting pays again


def test_a_pass_is_never_priced_above_a_measured_wider_one():
    """A slow first measurement of a rarely used width (150 ms for 2 tokens, against 110 for 3) does not
    keep that width unused: it is priced as the wider pass."""
    policy = calibrated([100, 150, 110, None, 130, None, None], draft_ms=10, alpha=0.8)
    assert policy.verify_estimate(2) == pytest.approx(0.110)
    assert policy.verify_estimate(1) == pytest.approx(0.100) and policy.verify_estimate(5) == pytest.approx(0.130)
    # width 4, unmeasured: the prior scaled from the cheapest width for its size (3), under the measured 5
    assert policy.verify_estimate(4) == pytest.approx(0.110 / (1 + 2 * 0.08) * (1 + 3 * 0.08))


def test_a_new_request_keeps_costs_and_little_of_the_acceptance():
    policy = calibrated([100] * 7, 10, alpha=0.9)
    before = policy.estimates().tries[0]
    policy.begin_request()
    assert policy.estimates().tries[0] == pytest.approx(before * policy.carry_over)
    assert policy.alpha(0) == pytest.approx(0.9, abs=0.01)  # still the same estimate, on fewer counts
    assert policy.verify_seconds[1] == pytest.approx(0.1)


def test_speculation_must_beat_plain_by_the_margin():
    """Marginal gains (within unmodelled overheads) are not worth drafting for."""
    policy = calibrated([100, 100, 100, 100, 100, 100, 100], draft_ms=40, alpha=0.45)
    assert policy.expected_tokens(1) / 0.14 > 1 / 0.1  # a 3% gain on paper...
    assert policy.choose(10) == 0  # ...is below the 5% margin


def test_observe_moves_the_estimates():
    policy = calibrated([100] * 7, 10, alpha=0.5)
    policy.estimates().hits, policy.estimates().tries = [0.0] * 6, [0.0] * 6
    for _ in range(30):
        policy.observe(4, 4, draft_seconds=0.04, verify_seconds=0.1)  # all accepted
    assert policy.alpha(0) > 0.9 and policy.alpha(3) > 0.9
    assert policy.alpha(5) == pytest.approx(policy.pooled_alpha())  # never verified: the pooled estimate
    assert policy.pooled_alpha() > 0.9
    for _ in range(60):
        policy.observe(4, 0, draft_seconds=0.04, verify_seconds=0.1)  # first token rejected
    assert policy.alpha(0) < 0.2
    policy.observe(4, 1, draft_seconds=0.06, verify_seconds=0.15)
    assert policy.verify_seconds[5] == pytest.approx(0.1 + policy.smoothing * 0.05)
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.01 + policy.smoothing * 0.005)


def test_a_stall_moves_a_cost_only_so_far_and_a_cost_not_timed_again_is_forgotten():
    """A stalled step counts as at most SPIKE times the estimate; a cost not re-timed within STALE_STEPS steps is
    forgotten, so a draft model priced out by a stall is guessed at its usual cost, tried, and timed anew (a shared
    machine's stall once kept the draft model unused for the rest of a 28-prompt run)."""
    policy = calibrated([50, 55, 60, 65, 70, 75, 80], draft_ms=15, alpha=0.7)
    policy.last_source = DEFAULT_SOURCE
    policy.observe(1, 1, draft_seconds=0.5, verify_seconds=2.0)  # a stall: 33x the draft's cost, 36x the pass's
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.015 * (1 + policy.smoothing * (SPIKE - 1)))
    assert policy.verify_seconds[2] == pytest.approx(0.055 * (1 + policy.smoothing * (SPIKE - 1)))
    stalled = AutoK(max_k=3)
    stalled.observe(0, 0, draft_seconds=0.0, verify_seconds=0.05)
    stalled.last_source = DEFAULT_SOURCE
    stalled.observe(1, 1, draft_seconds=0.06, verify_seconds=0.12)  # first timings taken in a stall
    est = stalled.estimates()
    est.read_seconds_per_token = 0.012
    est.hits, est.tries = [70.0] * 3, [100.0] * 3
    assert stalled.choose(3) == 0  # priced at more than a target pass a token: plain
    for _ in range(STALE_STEPS):
        stalled.observe(0, 0, draft_seconds=0.0, verify_seconds=0.05)  # plain steps: only one-token passes timed
    assert est.draft_seconds_per_token is None and est.read_seconds_per_token is None
    assert stalled.verify_seconds[2] is None and stalled.verify_seconds[1] == pytest.approx(0.05)
    assert stalled.choose(3, unread=64, remaining=100, generated=64) > 0  # guessed at its usual cost: tried again


def test_a_pass_estimate_follows_every_change_of_the_timings():
    """`verify_estimate` answers from a cache kept until the timings change (a batch asks it thousands of times a
    step): after each new timing, a forgotten width, a widened table and a whole new table it answers what a cost
    table built afresh from the same timings answers."""
    policy = calibrated([50, 60, None, 80], draft_ms=15, alpha=0.7)
    costs = policy.costs

    def fresh_answers() -> list:
        fresh = StepCosts(len(costs.verify_seconds))
        fresh.verify_seconds = costs.verify_seconds
        return [fresh.verify_estimate(w) for w in range(1, len(costs.verify_seconds) + 2)]

    def answers() -> list:
        return [costs.verify_estimate(w) for w in range(1, len(costs.verify_seconds) + 2)]

    before = answers()
    costs.time_pass(4, 0.200)  # the widest measured pass dearer: the slope, so every unmeasured width, moves
    assert answers() == fresh_answers() and answers()[2] > before[2]
    for _ in range(STALE_STEPS):
        costs.time_pass(1, 0.050)  # widths 2 and 4 not timed again: forgotten
    assert costs.verify_seconds[2] is None and answers() == fresh_answers()
    costs.widen(12)
    costs.time_pass(11, 0.300)
    assert answers() == fresh_answers() and costs.verify_estimate(11) == pytest.approx(0.300)
    policy.verify_seconds = [None, 0.020, 0.030]
    assert answers() == fresh_answers() and policy.verify_estimate(2) == pytest.approx(0.030)


def test_auto_k_is_exact_and_measures_the_target(tiny_target, drafts, make_lm):
    """`auto` only changes speed: greedy output equals plain decoding; the passes it ran got timed."""
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPT, max_new_tokens=40)
    for name in ("close", "far"):
        policy = AutoK(max_k=4)
        decoder = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts[name])), k=policy)
        got = decoder.generate(PROMPT, max_new_tokens=40)
        assert got.token_ids == expected.token_ids
        assert policy.verify_seconds[1] is not None or policy.verify_seconds[4] is not None  # measured as it ran
        assert len(got.stats.k_per_step) == got.stats.steps and max(got.stats.k_per_step) <= 4
        assert got.stats.to_dict()["mean_k"] == pytest.approx(got.stats.mean_k)


def test_auto_k_samples_reproducibly(tiny_target, drafts, make_lm):
    """Sampling with `auto`: k is chosen from the past only, before the step draws anything, so each
    step's verification stays exact; a seed reproduces the run when the costs are given."""
    params = SamplingParams(temperature=0.8, seed=11)
    runs = []
    for _ in range(2):
        policy = calibrated([10, 11, 12, 13, 14], draft_ms=1, alpha=0.7, max_k=4)
        policy.observe = lambda *args, **kwargs: None  # frozen costs: wall-clock noise must not change k here
        decoder = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts["close"])), k=policy)
        runs.append(decoder.generate(PROMPT, params, max_new_tokens=30))
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 30
    assert runs[0].stats.k_per_step == runs[1].stats.k_per_step and 0 < max(runs[0].stats.k_per_step) <= 4


def test_unmeasured_widths_get_an_optimistic_prior():
    """Nothing is timed up front: the first step drafts FIRST_K; widths not tried are priced from those that were."""
    from specdraft.policy import FIRST_K, PRIOR_SLOPE

    policy = AutoK(max_k=6)
    assert policy.verify_estimate(1) is None and policy.choose(10) == FIRST_K
    policy.observe(FIRST_K, FIRST_K, draft_seconds=0.03 * FIRST_K, verify_seconds=0.13)
    scale = 0.13 / (1 + PRIOR_SLOPE * FIRST_K)
    assert policy.verify_estimate(FIRST_K + 1) == pytest.approx(0.13)
    assert policy.verify_estimate(1) == pytest.approx(scale)
    assert policy.verify_estimate(7) == pytest.approx(scale * (1 + PRIOR_SLOPE * 6))


def test_unmeasured_widths_follow_the_slope_the_measured_ones_show():
    """Where each extra token of a pass costs much (an AVX2 CPU: 52 ms for one token, 70 for three), a width not
    tried yet is priced on that slope, not the flat prior; a flat machine keeps the prior."""
    from specdraft.policy import PRIOR_SLOPE

    steep = calibrated([52, None, 70, None, None, None, None], draft_ms=20, alpha=0.8)
    slope = (70 / 52 - 1) / 2  # (1 + 2s) / 1 = 70 / 52
    assert steep.verify_estimate(7) == pytest.approx(0.052 * (1 + slope * 6))
    assert steep.verify_estimate(7) > 0.052 * (1 + PRIOR_SLOPE * 6)
    flat = calibrated([100, None, 110, None, None, None, None], draft_ms=20, alpha=0.8)  # slope 0.05 < the prior
    assert flat.verify_estimate(7) == pytest.approx(0.110 / (1 + 2 * PRIOR_SLOPE) * (1 + PRIOR_SLOPE * 6))
    wider_cheaper = calibrated([100, None, 95, None, None, None, None], draft_ms=20, alpha=0.8)
    assert wider_cheaper.verify_estimate(5) == pytest.approx(0.095 / (1 + 2 * PRIOR_SLOPE) * (1 + 4 * PRIOR_SLOPE))


def test_draft_cost_ignores_the_catch_up_after_plain_steps():
    policy = calibrated([100] * 7, 10, alpha=0.9)
    policy.last_source = DEFAULT_SOURCE
    policy.observe(0, 0, draft_seconds=0.0, verify_seconds=0.1)  # a plain step
    policy.observe(2, 2, draft_seconds=2.0, verify_seconds=0.1, unread=199)  # the draft re-read what it missed
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.01)


def test_a_requests_first_draft_does_not_set_the_draft_cost():
    """The first draft of a request also reads the prompt into the draft model: timing it as drafting
    once priced the model draft at several target steps a token, and k = auto then never drafted."""
    policy = AutoK(max_k=4)
    policy.observe(0, 0, draft_seconds=0.0, verify_seconds=0.03)  # a plain step: costs are known
    policy.begin_request()
    policy.observe(3, 3, draft_seconds=1.5, verify_seconds=0.04, unread=300)  # prompt read + 3 tokens
    assert policy.estimates().draft_seconds_per_token is None
    assert policy.choose(8) > 0  # guessed at a third of a target step a token, with a fair prior: worth a draft
    policy.observe(3, 3, draft_seconds=0.03, verify_seconds=0.04, unread=1)  # caught up: timed
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.01)


def test_a_source_that_reads_nothing_is_timed_from_its_first_draft_though_the_pass_captured_a_graph():
    """Prompt lookup or the oracle read nothing before drafting, so their first draft is a draft's cost; a step
    whose target pass captured a CUDA graph (`timed=False`) still times its drafts. Before, a GPU batch's first
    drafting step captured a graph, its drafts went untimed, and the rule priced them by the guess (a third of a
    target step a token) for good: with the oracle at α 0.8, 4 to 16 requests never drafted."""
    policy = AutoK(max_k=4)
    policy.observe(0, 0, draft_seconds=0.0, verify_seconds=0.03)
    policy.begin_request()
    policy.observe(3, 3, draft_seconds=0.0003, verify_seconds=0.5, timed=False, drafts_timed=True)
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.0001)
    assert policy.verify_seconds[4] is None  # the pass that captured is not learnt
    policy.begin_request()
    policy.observe(3, 3, draft_seconds=0.0009, verify_seconds=0.04, timed=False, drafts_timed=False)
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.0001)  # neither is learnt


def test_a_draft_models_catch_up_is_shared_over_the_steps_left():
    """Reading 700 unseen prompt tokens (2 ms each) pays with 1,000 tokens left, not with 20."""
    policy = calibrated([30, 31, 32, 33, 34, 35, 36], draft_ms=10, alpha=0.8)
    policy.estimates().read_seconds_per_token = 0.002
    assert policy.catch_up_seconds(700) == pytest.approx(1.4)
    assert policy.choose(6, unread=0, remaining=20) > 0
    assert policy.choose(6, unread=700, remaining=1000) > 0
    assert policy.choose(6, unread=700, remaining=20) == 0


def test_the_catch_up_waits_until_the_answer_has_shown_it_is_long():
    """The budget does not say where an answer ends: the read is shared over as many tokens as the answer
    has run (at least ANSWER_FLOOR), so a dear read waits and a cheap one does not."""
    policy = calibrated([30, 31, 32, 33, 34, 35, 36], draft_ms=10, alpha=0.8)
    policy.estimates().read_seconds_per_token = 0.002
    assert policy.expected_left(0, 1000) == ANSWER_FLOOR and policy.expected_left(300, 1000) == 300
    assert policy.expected_left(300, 50) == 50 and policy.expected_left(None, 1000) == 1000
    assert policy.expected_left(5, None) == ANSWER_FLOOR
    assert policy.choose(6, unread=700, remaining=1000, generated=0) == 0  # 1.4 s over ~16 tokens: no
    assert policy.choose(6, unread=700, remaining=1000, generated=900) > 0  # over 900: yes
    assert policy.choose(6, unread=10, remaining=1000, generated=0) > 0  # 20 ms: at once


def test_no_probe_whose_catch_up_could_not_pay_back():
    """After a long plain streak a probe is due, but reading 60 missed tokens (0.12 s) in an answer expected to
    run ~16 more tokens (0.5 s of plain steps) is more than a tenth of that: it waits for a longer answer."""
    policy = calibrated([30, 33, 40, 47], draft_ms=12, alpha=0.2, max_k=3)
    policy.estimates().read_seconds_per_token = 0.002
    short = [policy.choose(3, unread=60, remaining=100, generated=5) for _ in range(3 * policy.probe_every)]
    assert short == [0] * len(short)
    assert policy.estimates().plain_streak > policy.probe_every  # overdue
    assert policy.choose(3, unread=60, remaining=1000, generated=400) == 1  # 0.12 s against 400 tokens: probed
    assert policy.estimates().probing
    cheap = calibrated([30, 33, 40, 47], draft_ms=12, alpha=0.2, max_k=3)
    assert [cheap.choose(3, unread=2, generated=5) for _ in range(cheap.probe_every + 1)][-1] == 1


def test_read_time_is_learnt_from_a_step_that_caught_up():
    policy = calibrated([30, 31, 32, 33], draft_ms=10, alpha=0.8, max_k=3)
    assert policy.estimates().read_seconds_per_token is None
    # the guess: the target's pass over 81 tokens less its one-token pass, scaled by c = 10 / 30
    assert policy.catch_up_seconds(80) == pytest.approx(10 / 30 * (policy.verify_estimate(81) - 0.030))
    policy.observe(2, 2, draft_seconds=0.02 + 0.1, verify_seconds=0.031, unread=50)  # 2 drafted, 50 read
    assert policy.estimates().read_seconds_per_token == pytest.approx(0.002)
    assert policy.estimates().draft_seconds_per_token == pytest.approx(0.010)  # not a caught-up step: kept
    policy.observe(2, 2, draft_seconds=0.02, verify_seconds=0.031, unread=READ_SAMPLE_MIN - 1)  # a few: nearly free
    assert policy.estimates().read_seconds_per_token == pytest.approx(0.002)  # not a read rate: kept


def test_an_untimed_read_is_priced_by_how_the_passes_grow_with_width():
    """Before a read is timed (or once it is forgotten), reading n tokens is priced as the target's pass over n
    tokens scaled by c. On a 2-core AVX2 CPU (each token of a pass adds ~0.38 of a plain step, the draft c = 0.3) a
    64-token first read took 0.14 s: priced so, a 20-token answer never pays it, where a flat guess (a 24th of a
    plain step a token: 0.056 s) let it draft. Where passes are flat (a GPU) the read stays cheap."""
    steep = calibrated([21, 25, 31.5, 38.7], draft_ms=6.5, alpha=0.6, max_k=3)
    assert 0.1 < steep.catch_up_seconds(64) < 0.2  # against 0.056 s by the flat guess
    steep.estimates().read_seconds_per_token = 0.0022  # once timed, the measurement rules
    assert steep.catch_up_seconds(64) == pytest.approx(64 * 0.0022)
    steep.estimates().read_seconds_per_token = None
    assert [steep.choose(3, unread=64, remaining=108, generated=g) for g in (20, 21, 22)] == [0, 0, 0]
    flat = calibrated([2.0, 2.0, 2.01, 2.02], draft_ms=1.2, alpha=0.6, max_k=3)
    assert flat.catch_up_seconds(64) <= 64 * 0.002 / 24  # no dearer than the flat guess
    tree = AutoK(max_k=8, tree=True)  # a tree's draft time is per step of several passes: a pass is guessed
    tree.verify_seconds = [None, 0.021, 0.025, 0.0315, 0.0387]
    tree.estimates().draft_seconds_per_token = 0.03
    assert tree.catch_up_seconds(64) == pytest.approx((tree.verify_estimate(65) - 0.021) / 3)


def test_the_engine_tells_the_policy_what_the_draft_model_has_not_read(tiny_target, drafts, make_lm):
    """First draft of a request: the whole prompt is unread (the draft model reads it lazily); later, the
    tokens committed since its last draft; `remaining` counts down the budget."""
    seen = []

    class Recording(FixedK):
        def choose(self, limit, source=DEFAULT_SOURCE, unread=0, remaining=None, generated=None):
            seen.append((unread, remaining, generated))
            return super().choose(limit, source, unread, remaining, generated)

    decoder = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts["close"])), k=Recording(3))
    decoder.generate(PROMPT, max_new_tokens=12)
    assert seen[0] == (len(PROMPT), 12, 0)
    assert all(1 <= unread <= 4 for unread, _, _ in seen[1:])  # at most k + 1 tokens committed per step
    assert [r for _, r, _ in seen] == sorted([r for _, r, _ in seen], reverse=True) and seen[-1][1] >= 1
    assert all(r + g == 12 for _, r, g in seen)  # the answer so far and the budget left


def tree_policy(verify_ms: list[float], draft_ms: float, budget: int = 8) -> AutoK:
    """A tree AutoK with given pass costs (index = tokens per pass) and per-step draft cost."""
    policy = AutoK(max_k=budget, tree=True)
    policy.verify_seconds = [None] + [ms / 1000 for ms in verify_ms]
    policy.estimates().draft_seconds_per_token = draft_ms / 1000
    return policy


def test_trim_keeps_what_the_scores_pay_for():
    """A greedy tree's prefix is kept while its scores pay for the wider pass: all of a sure tree on flat passes,
    little of an unsure one on dear passes; a fixed k keeps everything."""
    steep = [30 + 10 * t for t in range(10)]  # each token in the pass adds a third of a plain step
    flat = [30 + 0.5 * t for t in range(10)]
    sure, unsure = [0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4], [0.3, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01]
    assert tree_policy(flat, draft_ms=5).trim(sure) == 8
    assert tree_policy(steep, draft_ms=5).trim(unsure) == 1  # at least one token
    assert 1 < tree_policy(steep, draft_ms=5).trim(sure) < 8
    assert FixedK(3, tree_budget=8).trim(unsure) == 8
    assert AutoK(max_k=8, tree=True).trim(unsure) == 8  # nothing measured yet: no basis to cut


def test_trim_learns_how_far_to_trust_the_scores():
    """Scores that overstate acceptance (κ < 1) trim harder than scores that understate it; a new request keeps
    a quarter of what was learnt."""
    steep = [30 + 6 * t for t in range(10)]
    scores = [0.8, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15]
    fresh = tree_policy(steep, draft_ms=5).trim(scores)
    overstated, understated = tree_policy(steep, draft_ms=5), tree_policy(steep, draft_ms=5)
    for _ in range(40):
        overstated.observe(8, 0, 0.005, 0.08, path=[], scores=scores)  # nothing accepted
        understated.observe(8, 4, 0.005, 0.08, path=[0, 1, 2, 3], scores=[s / 2 for s in scores])
    assert overstated.score_calibration() < 0.2 and understated.score_calibration() > 1.5
    assert overstated.trim(scores) < fresh < understated.trim(scores)
    before = overstated.estimates().score_mass
    overstated.begin_request()
    assert overstated.estimates().score_mass == pytest.approx(before * overstated.carry_over)


def test_the_engine_trims_trees_but_never_a_drawn_token(tiny_target, drafts, make_lm):
    """Greedy: the engine verifies the prefix `trim` keeps (output still plain decoding's). Sampling: `trim` must
    keep the drawn chain (`keep`, the draft's drawn tokens, listed first); what it may cut are the point-mass
    siblings after them."""
    asked = []

    class Trimming(AutoK):
        def choose(self, limit, source=DEFAULT_SOURCE, unread=0, remaining=None, generated=None):
            return limit  # always the whole budget (timings must not decide whether a tree is drafted)

        def trim(self, scores, source=DEFAULT_SOURCE, keep=1):
            asked.append((len(scores), keep))
            return keep

    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPT, max_new_tokens=24)
    policy = Trimming(max_k=6, tree=True)
    drafter = ModelDrafter(make_lm(drafts["close"]))
    decoder = SpeculativeDecoder(make_lm(tiny_target), drafter, k=policy, tree_budget=6, tree_branch=2)
    got = decoder.generate(PROMPT, max_new_tokens=24)
    assert got.token_ids == expected.token_ids
    assert asked and max(n for n, _ in asked) > 1 and {keep for _, keep in asked} == {1}
    assert all(k <= 1 for k in got.stats.k_per_step)

    asked.clear()
    grown = []
    propose = drafter.propose
    drafter.propose = lambda ctx, k: grown.append(propose(ctx, k)) or grown[-1]
    sampled = decoder.generate(PROMPT, SamplingParams(temperature=0.8, seed=3), max_new_tokens=12)
    assert len(asked) == len(grown) and any(n > keep > 1 for n, keep in asked)
    for (n, keep), draft, k in zip(asked, grown, [k for k in sampled.stats.k_per_step if k]):
        assert (keep == draft.drawn == draft.layout.height) if draft.layout else (keep == draft.k)
        one_hot = (draft.q_draft == 1.0).sum(-1) == 1  # [n]: point-mass rows
        assert not one_hot[:keep].all() and one_hot[keep:].all() and k == keep


def test_widened_auto_k_drafts_past_the_cpu_cap_when_wide_passes_are_cheap():
    """On a GPU (`widen`, as the engine does there) a sure drafter with flat pass costs drafts well past 8."""
    policy = AutoK()
    policy.widen(GPU_MAX_AUTO_K)
    assert policy.max_k == policy.max_depth == GPU_MAX_AUTO_K and len(policy.verify_seconds) == GPU_MAX_AUTO_K + 2
    for _ in range(40):
        k = policy.choose(40)
        policy.observe(k, k, 0.0001 * k, 0.004 * (1 + 0.005 * k))
    assert policy.choose(40) > MAX_AUTO_K
    narrow = AutoK(max_k=4, tree=True)
    narrow.widen(GPU_MAX_AUTO_K)  # a tree keeps its node budget
    assert narrow.max_k == 4
