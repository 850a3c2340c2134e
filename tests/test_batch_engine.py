"""Continuous batching (`batch_engine.BatchedDecoder`): every request of a batch gets what it gets alone, requests
join and leave mid-generation, a cancelled one frees its slot and its cache rows."""

from __future__ import annotations

import pytest

from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder
from specdraft.batch_engine import BatchedDecoder, BatchRequest
from specdraft.drafters import NgramDrafter
from specdraft.errors import SpecdraftError

PROMPTS = [[5, 17, 42, 8, 59, 3], [7, 7, 7, 1], [11, 12, 13, 14, 15, 11, 12, 13], [30], [2, 40, 2, 40, 2],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8]]
BUDGETS = [24, 9, 30, 17, 12, 20]


def requests(sampling: SamplingParams | None = None) -> list[BatchRequest]:
    return [BatchRequest(prompt, sampling or SamplingParams(temperature=0.0), budget)
            for prompt, budget in zip(PROMPTS, BUDGETS)]


def alone(target, prompt, budget, sampling=None) -> list[int]:
    return SpeculativeDecoder(target).generate(prompt, sampling or SamplingParams(temperature=0.0),
                                               max_new_tokens=budget).token_ids


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_each_request_of_a_batch_gets_its_greedy_output_alone(tiny_target, drafts, make_lm, drafter):
    """Three slots for six requests of different budgets: requests join as others finish, mid-generation."""
    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(PROMPTS, BUDGETS)]
    makers = {"none": None, "ngram": lambda: NgramDrafter(),
              "model": lambda: ModelDrafter(make_lm(drafts["close"], name="draft"))}
    batch = BatchedDecoder(make_lm(tiny_target), makers[drafter], max_batch=3)
    completions = batch.generate_all(requests())
    assert [c.token_ids for c in completions] == expected
    assert max(batch.batch_sizes) == 3 and not batch.active and batch.target.cache_len == 0 and not batch.row_owner
    if drafter != "none":
        assert sum(c.stats.drafted for c in completions) > 0 and sum(c.stats.accepted for c in completions) > 0
        assert all(c.stats.steps < len(c.token_ids) for c in completions if c.stats.accepted > len(c.token_ids) // 2)


def test_plain_sampled_requests_draw_what_they_draw_alone(tiny_target, make_lm):
    """Each sequence samples from its own seeded generator: plain batched sampling reproduces the single runs."""
    target = make_lm(tiny_target)
    params = [SamplingParams(temperature=0.9, top_k=20, seed=seed) for seed in range(len(PROMPTS))]
    expected = [alone(target, p, b, s) for p, b, s in zip(PROMPTS, BUDGETS, params)]
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=4)
    got = batch.generate_all([BatchRequest(p, s, b) for p, b, s in zip(PROMPTS, BUDGETS, params)])
    assert [c.token_ids for c in got] == expected


def test_cache_rows_follow_the_sequences_and_a_cancel_frees_them(tiny_target, drafts, make_lm):
    batch = BatchedDecoder(make_lm(tiny_target), lambda: ModelDrafter(make_lm(drafts["close"], name="draft")),
                           max_batch=2)
    first, second = (batch.add(r) for r in requests()[:2])
    with pytest.raises(SpecdraftError, match="batch is full"):
        batch.add(requests()[2])
    for _ in range(3):
        batch.step()
        assert batch.target.cache_len == len(batch.row_owner) == sum(seq.run.sequence.shape[0] - 1
                                                                     for seq in batch.active)
    batch.cancel(second)
    assert [seq.ident for seq in batch.active] == [first] and set(batch.row_owner) == {first}
    tokens = list(batch.active[0].run.generated)
    while batch.active:
        tokens += [t for _, event in batch.step() for t in event.token_ids]
    assert tokens == alone(make_lm(tiny_target), PROMPTS[0], BUDGETS[0])


def test_bad_requests_are_refused_before_they_join(tiny_target, make_lm):
    batch = BatchedDecoder(make_lm(tiny_target))
    for bad in (BatchRequest([]), BatchRequest([5, 10_000]), BatchRequest([5], max_new_tokens=0)):
        with pytest.raises(SpecdraftError):
            batch.add(bad)
    assert not batch.active and batch.target.cache_len == 0
    with pytest.raises(SpecdraftError, match="at least one sequence"):
        BatchedDecoder(make_lm(tiny_target), max_batch=0)
