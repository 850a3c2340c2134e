"""Continuous batching (`batch_engine.BatchedDecoder`): every request of a batch gets what it gets alone, requests
join and leave mid-generation, a cancelled one frees its slot and its cache rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder
from specdraft.batch_engine import BatchedDecoder, BatchRequest, NoRoom, OverBudget
from specdraft.drafters import NgramDrafter
from specdraft.errors import SpecdraftError
from specdraft.goodput import REALIZED_STEPS
from specdraft.models.causal_lm import CausalLM
from specdraft.models.packed_cache import PackedCache
from specdraft.step import PLAIN, Plan

PROMPTS = [[5, 17, 42, 8, 59, 3], [7, 7, 7, 1], [11, 12, 13, 14, 15, 11, 12, 13], [30], [2, 40, 2, 40, 2],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8]]
BUDGETS = [24, 9, 30, 17, 12, 20]


def requests(sampling: SamplingParams | None = None) -> list[BatchRequest]:
    return [BatchRequest(prompt, sampling or SamplingParams(temperature=0.0), budget)
            for prompt, budget in zip(PROMPTS, BUDGETS)]


def alone(target, prompt, budget, sampling=None) -> list[int]:
    return SpeculativeDecoder(target).generate(prompt, sampling or SamplingParams(temperature=0.0),
                                               max_new_tokens=budget).token_ids


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "model-spliced"])
def test_each_request_of_a_batch_gets_its_greedy_output_alone(tiny_target, drafts, make_lm, drafter):
    """Three slots for six requests of different budgets: requests join as others finish, mid-generation
    (`model-spliced`: each catch-up reads only the last token it missed)."""
    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(PROMPTS, BUDGETS)]
    makers = {"none": None, "ngram": lambda: NgramDrafter(),
              "model": lambda: ModelDrafter(make_lm(drafts["close"], name="draft")),
              "model-spliced": lambda: ModelDrafter(make_lm(drafts["close"], name="draft"), catch_up=1)}
    batch = BatchedDecoder(make_lm(tiny_target), makers[drafter], max_batch=3)
    completions = batch.generate_all(requests())
    assert [c.token_ids for c in completions] == expected
    assert batch.largest_batch == 3 and not batch.active and batch.target.cache_len == 0 and not batch.row_owner
    if drafter != "none":
        assert sum(c.stats.drafted for c in completions) > 0 and sum(c.stats.accepted for c in completions) > 0
        assert all(c.stats.steps < len(c.token_ids) for c in completions if c.stats.accepted > len(c.token_ids) // 2)


class RecordingNgram(NgramDrafter):
    """An n-gram drafter that asks for the target's features and keeps them: what a feature drafter is handed."""

    needs_features = True

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[torch.Tensor] = []

    def features(self, hidden: torch.Tensor) -> None:  # [n, H]
        self.handed.append(hidden.float().clone())


@pytest.mark.parametrize("drafter,tree_budget", [("ngram", 6), ("model", 6), ("eagle", 0), ("eagle", 5),
                                                 ("medusa", 5)])
def test_trees_and_feature_drafters_in_a_batch_answer_as_alone(tiny_target, drafts, make_lm, monkeypatch, drafter,
                                                               tree_budget):
    """Tree drafts (the draft model's grown over the packed draft cache) and drafters that read the target's
    features run in the batch: every answer is its greedy answer alone."""
    from registered_drafters import random_eagle, random_medusa

    import specdraft.step as step

    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(PROMPTS, BUDGETS)]
    batch = BatchedDecoder(make_lm(tiny_target), max_batch=3, tree_budget=tree_budget)
    makers = {"ngram": NgramDrafter, "model": lambda: ModelDrafter(make_lm(drafts["close"], name="draft")),
              "eagle": lambda: random_eagle(batch.target), "medusa": lambda: random_medusa(batch.target)}
    batch.make_drafter = makers[drafter]
    trees, verify = [], step.verify
    monkeypatch.setattr(step, "verify", lambda draft, *rest: (trees.append(draft.layout is not None),
                                                                      verify(draft, *rest))[1])
    completions = batch.generate_all(requests())
    assert [c.token_ids for c in completions] == expected
    assert sum(c.stats.drafted for c in completions) > 0 and batch.largest_batch == 3
    assert any(trees) == (bool(tree_budget) and drafter != "ngram")  # the n-gram's trees here: single chains
    assert batch.target.cache_len == 0 and not batch._draft_caches


@pytest.mark.parametrize("tree_budget", [0, 4])
def test_a_drafter_in_a_batch_reads_the_features_it_reads_alone(tiny_target, make_lm, tree_budget):
    """The target's final hidden states a feature drafter gets in a batch (the prompt's as it joins, then each
    step's kept rows) are those it gets alone, row for row."""
    alone_handed = []
    for prompt, budget in zip(PROMPTS[:3], BUDGETS[:3]):
        drafter = RecordingNgram()
        SpeculativeDecoder(make_lm(tiny_target), drafter, tree_budget=tree_budget).generate(
            prompt, SamplingParams(temperature=0.0), max_new_tokens=budget)
        alone_handed.append(torch.cat(drafter.handed))
    made = []
    batch = BatchedDecoder(make_lm(tiny_target), lambda: made.append(RecordingNgram()) or made[-1], max_batch=3,
                           tree_budget=tree_budget)
    completions = batch.generate_all(requests()[:3])
    assert sum(c.stats.accepted for c in completions) > 0
    for drafter, expected, completion in zip(made, alone_handed, completions):
        handed = torch.cat(drafter.handed)  # [prompt + answer - 1, H]: every position but the last, once
        assert handed.shape[0] == completion.stats.prompt_tokens + len(completion.token_ids) - 1
        torch.testing.assert_close(handed, expected, rtol=1e-4, atol=1e-4)


def test_the_draft_models_of_a_batch_draft_a_depth_in_one_pass(tiny_target, drafts, make_lm, monkeypatch):
    """Sequences drafting with the same weights share one packed draft cache: their tokens of a depth go through the
    draft model in one pass, and each answer is still its answer alone."""
    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(PROMPTS[:3], BUDGETS[:3])]
    widths, caches, run = [], set(), PackedCache.run
    monkeypatch.setattr(PackedCache, "run", lambda self, feeds, prompt=False: (
        widths.append(len(feeds)), caches.add(self), run(self, feeds, prompt))[2])
    batch = BatchedDecoder(make_lm(tiny_target), lambda: ModelDrafter(make_lm(drafts["close"], name="draft")),
                           max_batch=3)
    got = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), b, k=3)
                              for p, b in zip(PROMPTS[:3], BUDGETS[:3])])
    assert [c.token_ids for c in got] == expected
    assert widths[:3] == [1, 1, 1]  # each first read leads a pass of its own (its first token on precise kernels)
    assert widths.count(3) >= 5 and len(widths) < sum(widths)  # passes, against one a sequence and depth alone
    [packed] = caches  # one draft cache for the three sequences: the same weights
    assert packed.lm.cache_len == 0 and not packed.row_owner  # the rows left with their sequences
    assert not batch._draft_caches  # and the cache with the last of them


def test_a_batch_size_where_drafting_gave_less_steps_plain_and_answers_as_alone(tiny_target, drafts, make_lm):
    """Realized rates that say drafting loses with two sequences (`goodput.RealizedGoodput`) keep a batch of two
    plain until it tries again; a sequence alone still drafts as its policy says."""
    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(PROMPTS[:2], [30, 12])]
    batch = BatchedDecoder(make_lm(tiny_target), lambda: ModelDrafter(make_lm(drafts["identical"], name="draft")),
                           max_batch=2)
    for _ in range(REALIZED_STEPS):
        batch.realized.record(2, False, 2, 0.01)
        batch.realized.record(2, True, 2, 0.02)
    drafted, step = [], batch.step
    batch.step = lambda: (events := step(), drafted.append((batch.last_step.sequences, batch.last_step.drafted)),
                          events)[0]
    got = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), b) for p, b in zip(PROMPTS[:2], [30, 12])])
    assert [c.token_ids for c in got] == expected
    assert all(k == 0 for size, k in drafted if size == 2) and any(size == 2 for size, _ in drafted)
    assert any(k > 0 for size, k in drafted if size == 1)  # alone, the identical draft drafts


def test_after_the_rule_chose_plain_the_next_steps_do_not_ask(tiny_target, drafts, make_lm, monkeypatch):
    """Planning (each sequence's policy, the goodput rule) is host work a plain batch never does: once every
    sequence of a batch size stepped plain though asked, the next PAUSE_STEPS steps there step plain without asking,
    and the answers are as alone."""
    from specdraft import step
    from specdraft.goodput import PAUSE_STEPS

    target = make_lm(tiny_target)
    expected = [alone(target, p, 30) for p in PROMPTS[:2]]
    batch = BatchedDecoder(make_lm(tiny_target), lambda: ModelDrafter(make_lm(drafts["identical"], name="draft")),
                           max_batch=2)
    asked, choose_source = [], step.choose_source
    monkeypatch.setattr(step, "choose_source", lambda *args: (asked.append(1), choose_source(*args))[1])
    monkeypatch.setattr(BatchedDecoder, "_choose", lambda self, stepping, plans: [0] * len(plans))  # the rule: plain
    got = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), 30) for p in PROMPTS[:2]])
    assert [c.token_ids for c in got] == expected and sum(c.stats.drafted for c in got) == 0
    steps = max(c.stats.steps for c in got)
    assert 2 * (steps // (PAUSE_STEPS + 1)) <= len(asked) <= 2 * (steps // (PAUSE_STEPS + 1) + 2)  # both, 1 step in 5


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


def test_kv_bytes_per_token_is_what_a_cached_token_takes(tiny_target, make_lm):
    target = make_lm(tiny_target)
    target.prefill(torch.tensor([PROMPTS[0]]))
    held = sum(t.numel() * t.element_size() for layer in target._cache.layers for t in (layer.keys, layer.values))
    assert target.kv_bytes_per_token * target.cache_len == held > 0


def test_a_kv_budget_holds_requests_until_others_leave_and_refuses_what_never_fits(tiny_target, drafts, make_lm):
    """Each sequence reserves prompt + budget rows of cache (its draft model's too) as it joins: past the KV budget
    a request waits (NoRoom) and joins once others leave, with its answer alone; one that never fits is refused."""
    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(PROMPTS, BUDGETS)]
    per_token = target.kv_bytes_per_token
    needs = [(len(p) + b) * per_token for p, b in zip(PROMPTS, BUDGETS)]
    budget = needs[0] + needs[1]  # room for the first two, and for any one
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=6, kv_budget=budget)
    first, second = (batch.add(r) for r in requests()[:2])
    assert batch.kv_reserved == budget
    with pytest.raises(NoRoom, match="KV budget"):
        batch.add(requests()[2])
    assert batch.size == 2
    batch.cancel(second)
    assert batch.kv_reserved == needs[0]
    batch.cancel(first)
    reserved, step = [], batch.step
    batch.step = lambda: (reserved.append(batch.kv_reserved), step())[1]
    completions = batch.generate_all(requests())
    assert [c.token_ids for c in completions] == expected
    assert max(reserved) <= budget and batch.kv_reserved == 0
    assert batch.largest_batch < len(PROMPTS)  # the budget, not max_batch, held the batch back
    with pytest.raises(OverBudget, match="KV cache"):
        batch.add(BatchRequest(PROMPTS[0], max_new_tokens=budget // per_token))
    assert batch.size == 0
    draft = ModelDrafter(make_lm(drafts["close"], name="draft"))
    assert batch.kv_need(5, 7, draft) == 12 * (per_token + draft.model.kv_bytes_per_token)


def test_bad_requests_are_refused_before_they_join(tiny_target, make_lm):
    batch = BatchedDecoder(make_lm(tiny_target))
    for bad in (BatchRequest([]), BatchRequest([5, 10_000]), BatchRequest([5], max_new_tokens=0)):
        with pytest.raises(SpecdraftError):
            batch.add(bad)
    assert not batch.active and batch.target.cache_len == 0
    with pytest.raises(SpecdraftError, match="at least one sequence"):
        BatchedDecoder(make_lm(tiny_target), max_batch=0)


# ---- sampled verification in a batch: the target's exact distribution, per sequence ------------------------------

STAT_V = 8
STAT_PROMPT = [1, 2, 3, 4, 1, 2, 3]  # the tail [2, 3] occurred before: ngram proposes from the first step
STAT_SAMPLES = 1200  # sequences, 8 to a batch (each k twice)
STAT_BATCH = 8


class MixedK(BatchedDecoder):
    """The batch's sequences draft 3, 0, 2 and 1 tokens in one pass (where their drafter has something)."""

    @staticmethod
    def _plan(seq, ctx, limit, rules):  # the planted ks, whatever the realized rates say
        source = seq.drafter.source(ctx) if seq.drafter is not None and limit > 0 else None
        k = min((3, 0, 2, 1)[seq.ident % 4], limit) if source is not None else 0
        return Plan(source, k, seq.drafter.unread(ctx)) if k else PLAIN

    def _choose(self, stepping, plans):
        return [plan.k for plan in plans]


def batched_pairs(target_model, make_drafter, decoder_class=MixedK, tree_budget=0):
    """[V * V] counts of each sequence's first two tokens, over STAT_SAMPLES sequences sampled STAT_BATCH at a time."""
    from specdraft.models.causal_lm import CausalLM

    counts = [0] * (STAT_V * STAT_V)
    batch = decoder_class(CausalLM(target_model), make_drafter, max_batch=STAT_BATCH, tree_budget=tree_budget)
    drafted = 0
    for first in range(0, STAT_SAMPLES, STAT_BATCH):
        done = batch.generate_all([BatchRequest(STAT_PROMPT, SamplingParams(temperature=1.0, seed=seed), 4)
                                   for seed in range(first, first + STAT_BATCH)])
        for completion in done:
            a, b = completion.token_ids[:2]
            counts[a * STAT_V + b] += 1
            drafted += completion.stats.drafted
    return np.array(counts, dtype=float), drafted


@pytest.fixture(scope="module")
def stat_target():
    import torch
    from transformers import Qwen2ForCausalLM

    from conftest import tiny_config

    torch.manual_seed(7)
    model = Qwen2ForCausalLM(tiny_config(vocab_size=STAT_V, layers=2)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("drafter,tree_budget", [pytest.param("ngram", 0, marks=pytest.mark.slow), ("model", 0),
                                                 ("model", 3)])  # the draft model's q, chains and trees, quick
def test_batched_sampling_with_a_different_k_per_sequence_follows_the_target(stat_target, drafter, tree_budget):
    from conftest import perturbed
    from specdraft.exactness import exact_two_tokens
    from specdraft.goodness_of_fit import chi_square_pvalue
    from specdraft.models.causal_lm import CausalLM

    draft = perturbed(stat_target, noise=0.5, seed=3)
    makers = {"ngram": lambda: NgramDrafter(), "model": lambda: ModelDrafter(CausalLM(draft), min_confidence=0.0)}
    counts, drafted = batched_pairs(stat_target, makers[drafter], tree_budget=tree_budget)
    assert drafted > STAT_SAMPLES // 2
    pvalue = chi_square_pvalue(counts, exact_two_tokens(stat_target, STAT_PROMPT).ravel() * STAT_SAMPLES)
    assert pvalue > 1e-3, f"batched {drafter}: p-value {pvalue:.3g}"


def test_verifying_a_sequence_against_its_neighbours_rows_is_caught(stat_target):
    """Negative control: each sequence verified against the pass's rows one token off (a neighbour's at the edges)."""
    import torch

    from specdraft.exactness import exact_two_tokens
    from specdraft.goodness_of_fit import chi_square_pvalue

    class OffByOne(MixedK):
        def step(self):
            forward = self.target.forward

            def shifted(*args, **kwargs):
                out = forward(*args, **kwargs)
                out.logits = torch.roll(out.logits, 1, dims=1)
                return out

            self.target.forward = shifted
            try:
                return super().step()
            finally:
                del self.target.forward

    counts, _ = batched_pairs(stat_target, lambda: NgramDrafter(), OffByOne)
    pvalue = chi_square_pvalue(counts, exact_two_tokens(stat_target, STAT_PROMPT).ravel() * STAT_SAMPLES)
    assert pvalue < 1e-6, f"rows off by one went unnoticed: p-value {pvalue:.3g}"


def test_a_request_joins_after_the_packed_cache_grew_during_the_steps(tiny_target, make_lm):
    """Three long answers grow the packed cache past its first buffer inside the passes (inference tensors); a
    fourth request joining then appends its prompt's rows there (once failed: in-place update outside inference
    mode, which wedged the server's engine thread)."""
    prompts, budgets = PROMPTS[:4], [100, 100, 120, 20]
    target = make_lm(tiny_target)
    expected = [alone(target, p, b) for p, b in zip(prompts, budgets)]
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=3)
    got = batch.generate_all([BatchRequest(p, SamplingParams(temperature=0.0), b) for p, b in zip(prompts, budgets)])
    assert [c.token_ids for c in got] == expected


def test_rows_append_to_a_cache_the_passes_made(tiny_target, make_lm):
    """The cache's buffers come from passes (inference tensors); appending a prompt read alone writes into them
    (this once failed outside inference mode, and wedged the server's engine thread)."""
    import torch

    target, reader = make_lm(tiny_target), make_lm(tiny_target)
    target.prefill(torch.tensor([[5, 17, 42]]))
    reader.prefill(torch.tensor([[7, 7]]))
    target.append_cache(reader)
    assert target.cache_len == 5


def test_a_request_that_fails_to_join_leaves_the_cache_as_it_was(tiny_target, make_lm, monkeypatch):
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=3)
    first = batch.add(BatchRequest(PROMPTS[0], SamplingParams(temperature=0.0), 8))
    batch.step()
    append = batch.target.append_cache

    def half_then_fail(other):
        append(other)
        raise RuntimeError("planted")

    monkeypatch.setattr(batch.target, "append_cache", half_then_fail)
    broken = batch.add(BatchRequest(PROMPTS[2], SamplingParams(temperature=0.0), 8))
    batch.step()  # reads the new prompt, fails to append it, steps the first
    assert [(ident, str(error)) for ident, error in batch.take_failed()] == [(broken, "planted")]
    assert batch.take_failed() == [] and [s.ident for s in batch.active] == [first] and not batch.joining
    assert batch.target.cache_len == len(batch.row_owner) == batch.active[0].run.sequence.shape[0] - 1
    assert set(batch.row_owner) == {first} and batch.stats(broken) is None


def test_a_long_prompt_is_read_a_chunk_between_steps_and_answers_as_alone(tiny_target, make_lm, monkeypatch):
    """A prompt longer than a chunk joins over several steps while the others go on generating, and gets what it
    gets alone (whose prefill reads the same chunks)."""
    from specdraft.models import causal_lm

    monkeypatch.setattr(causal_lm, "PREFILL_CHUNK", 8)
    monkeypatch.setattr("specdraft.batch_engine.PREFILL_CHUNK", 8)
    long_prompt = [(7 * i + 3) % 60 for i in range(30)]
    expected = [alone(make_lm(tiny_target), p, b) for p, b in ((PROMPTS[0], 20), (long_prompt, 10))]
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=2)
    first = batch.add(BatchRequest(PROMPTS[0], SamplingParams(temperature=0.0), 20))
    tokens = {first: [t for _, event in batch.step() for t in event.token_ids]}
    second = batch.add(BatchRequest(long_prompt, SamplingParams(temperature=0.0), 10))
    tokens[second] = []
    stepped = []  # who stepped, each step while the long prompt is read
    while batch.joining:
        events = batch.step()
        stepped.append([ident for ident, _ in events])
        for ident, event in events:
            tokens[ident] += event.token_ids
    # 29 prompt tokens before its last, 8 a step: the first goes on meanwhile, the second steps once all are read
    assert stepped == [[first]] * 3 + [[first, second]]
    while batch.active:
        for ident, event in batch.step():
            tokens[ident] += event.token_ids
    assert [tokens[first], tokens[second]] == expected
    assert batch.stats(second) is None and batch.target.cache_len == 0


@pytest.mark.parametrize("drafter,tree_budget", [("none", 0), ("model", 0), ("model", 6), ("ngram", 6)])
def test_a_batch_on_static_caches_answers_as_alone(tiny_target, drafts, monkeypatch, drafter, tree_budget):
    """The GPU's static cache (run eagerly here, `SPECDRAFT_STATIC_CACHE=1`) holds a packed batch too: prompts read
    into a static cache of their own join it, draft models share one static packed cache, rows leave as their
    sequences do, and the cache grows past its first slots (a small capacity) on the way. Before, every request of
    a batch failed on a GPU ("the static one is not supported")."""
    from specdraft.models import graph_decoder

    monkeypatch.setenv("SPECDRAFT_STATIC_CACHE", "1")
    monkeypatch.setattr(graph_decoder, "DEFAULT_CAPACITY", 64)
    target = CausalLM(tiny_target, name="tiny")
    assert target.static
    makers = {"none": None, "ngram": lambda: NgramDrafter(),
              "model": lambda: ModelDrafter(CausalLM(drafts["close"], name="draft", static_cache=False))}
    expected = [SpeculativeDecoder(target, makers[drafter]() if makers[drafter] else None, tree_budget=tree_budget)
                .generate(p, SamplingParams(temperature=0.0), max_new_tokens=b).token_ids
                for p, b in zip(PROMPTS, BUDGETS)]
    packed_static, init = [], PackedCache.__init__
    monkeypatch.setattr(PackedCache, "__init__", lambda self, lm: (packed_static.append(lm.static), init(self, lm))[1])
    batch = BatchedDecoder(target, makers[drafter], max_batch=3, tree_budget=tree_budget)
    got = batch.generate_all(requests())
    assert [c.token_ids for c in got] == expected
    assert batch.largest_batch == 3 and target.cache_len == 0 and not batch.row_owner
    assert batch._reader.static and target._static.cache.capacity > 64  # grown on the way
    if drafter == "model":
        assert sum(c.stats.accepted for c in got) > 0
        assert packed_static and all(packed_static)
        assert not batch._draft_caches  # every sequence left, and the packed draft cache with the last of them


def test_a_packed_draft_cache_with_captured_passes_outlives_an_empty_batch(tiny_target, drafts, make_lm,
                                                                            monkeypatch):
    """A draft model's packed cache whose passes replay captured graphs (a GPU's) is kept when the batch empties, so
    the next request drafting with those weights does not capture them again; one that captures none goes. Answers
    stay as alone."""
    made, init = [], PackedCache.__init__
    monkeypatch.setattr(PackedCache, "__init__", lambda self, lm: (made.append(self), init(self, lm))[1])
    target = make_lm(tiny_target)
    draft = make_lm(drafts["close"], name="draft")
    expected = [alone(target, p, b) for p, b in zip(PROMPTS[:2], BUDGETS[:2])]
    for captures, caches in ((False, 2), (True, 1)):
        made.clear()
        if captures:
            monkeypatch.setattr(CausalLM, "widest_graph", property(lambda self: 64))
        batch = BatchedDecoder(target, lambda: ModelDrafter(CausalLM(draft.model, name="draft")), max_batch=1)
        for prompt, budget, answer in zip(PROMPTS[:2], BUDGETS[:2], expected):  # one after the other
            got = batch.generate_all([BatchRequest(prompt, SamplingParams(temperature=0.0), budget)])
            assert got[0].token_ids == answer
        assert len(made) == caches and len(batch._draft_caches) == int(captures)  # kept idle where it captures
        assert all(packed.lm.cache_len == 0 for packed in batch._draft_caches.values())


def test_a_batch_drafts_within_the_widest_captured_pass(tiny_target, make_lm, monkeypatch):
    """On a GPU a pass wider than the widest captured graph runs eagerly, at several times its cost: a batch's
    drafts keep every step within it (here 5 tokens for 3 sequences, whose drafters would each draft more), from
    the first step on, and the answers are as alone."""
    from specdraft.drafters.oracle import OracleDrafter

    target = make_lm(tiny_target)
    monkeypatch.setattr(CausalLM, "widest_graph", property(lambda self: 5))
    greedy = SamplingParams(temperature=0.0)
    prompts, budget = PROMPTS[:3], 16
    answers = [alone(target, prompt, budget) for prompt in prompts]

    def oracle(prompt: list[int], answer: list[int]):
        def make():
            drafter = OracleDrafter(alpha=1.0, seed=0)
            drafter.record(prompt + answer)
            return drafter
        return make

    batch = BatchedDecoder(target, None, max_batch=3)
    widths, step = [], batch.step
    batch.step = lambda: (events := step(), widths.append(batch.last_step and (batch.last_step.sequences,
                                                                               batch.last_step.width)))[0]
    got = batch.generate_all([BatchRequest(p, greedy, budget, make_drafter=oracle(p, a))
                              for p, a in zip(prompts, answers)])
    assert [c.token_ids for c in got] == answers
    full = [width for size_width in widths if size_width and size_width[0] == 3 for width in size_width[1:]]
    assert full and max(full) == 5  # drafting, and never past the widest graph
    assert sum(c.stats.accepted for c in got) > 0


@pytest.mark.parametrize("static,tree_budget", [(False, 0), (False, 6), (True, 0), (True, 6)])
def test_sequences_of_a_batch_stop_at_the_context_as_alone(monkeypatch, static, tree_budget):
    """A batch's packed cache holds several sequences, so its length is no position: each pass says how far its
    furthest token reaches (`CausalLM.forward(reach=)`). Answers that run into a 40-position context stop there as
    alone, chains and trees, on the growing cache and the static one, though the packed cache holds far more rows."""
    from conftest import perturbed, tiny_config, tiny_model

    if static:
        monkeypatch.setenv("SPECDRAFT_STATIC_CACHE", "1")
    target_model = tiny_model(tiny_config(max_positions=40), seed=0)
    draft_model = perturbed(target_model, noise=0.0, seed=1)  # always right: drafts run to the very end
    make = lambda: ModelDrafter(CausalLM(draft_model, static_cache=False))  # noqa: E731
    target = CausalLM(target_model)
    prompts = [[5, 17, 42, 8, 59, 3], [7, 7, 7, 1], [11, 12, 13]]
    greedy = SamplingParams(temperature=0.0)
    expected = [SpeculativeDecoder(target, make(), tree_budget=tree_budget).generate(p, greedy, max_new_tokens=60)
                for p in prompts]
    assert all(e.finish_reason == "length" and len(p) + len(e.token_ids) == 40 for p, e in zip(prompts, expected))
    batch = BatchedDecoder(target, make, max_batch=3, tree_budget=tree_budget)
    got = batch.generate_all([BatchRequest(p, greedy, 60) for p in prompts])
    assert [c.token_ids for c in got] == [e.token_ids for e in expected]
    assert [c.finish_reason for c in got] == ["length"] * 3 and batch.largest_batch == 3


def test_greedy_chains_verified_together_beside_sampled_and_penalised_sequences(tiny_target, drafts, make_lm):
    """One batch mixing the kinds of verification: greedy chains (verified together, from one host read of the rows'
    argmax), sampled ones and a greedy one under a repetition penalty (each verified as alone); each answers as
    alone (a sampled request with a fixed k draws what it draws alone). Trees take the per-sequence path: the tests
    above."""
    target = make_lm(tiny_target)
    make = lambda: ModelDrafter(make_lm(drafts["close"], name="draft"))  # noqa: E731
    kinds = [(SamplingParams(temperature=0.0), None), (SamplingParams(temperature=0.8, seed=3), 2),
             (SamplingParams(temperature=0.0, repetition_penalty=1.3), None), (SamplingParams(temperature=0.0), None),
             (SamplingParams(temperature=1.0, top_p=0.9, seed=7), 3), (SamplingParams(temperature=0.0), 4)]
    expected = [SpeculativeDecoder(target, make(), k=k or "auto").generate(p, s, max_new_tokens=b).token_ids
                for p, b, (s, k) in zip(PROMPTS, BUDGETS, kinds)]
    batch = BatchedDecoder(make_lm(tiny_target), make, max_batch=6)
    got = batch.generate_all([BatchRequest(p, s, b, k=k) for p, b, (s, k) in zip(PROMPTS, BUDGETS, kinds)])
    assert [c.token_ids for c in got] == expected and batch.largest_batch == 6
    assert sum(c.stats.accepted for c in got) > 0


def test_each_step_says_what_its_pass_was_and_a_step_without_one_says_none(tiny_target, make_lm, monkeypatch):
    """`last_step`: the pass's width (every sequence's block) and its timed seconds; a step that only read a joining
    prompt ran no pass, so the server's metrics must not count the step before it again."""
    from specdraft.models import causal_lm

    monkeypatch.setattr(causal_lm, "PREFILL_CHUNK", 4)
    monkeypatch.setattr("specdraft.batch_engine.PREFILL_CHUNK", 4)
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=2)
    seen = []

    def run() -> None:
        while batch.size:
            batch.step()
            step = batch.last_step
            seen.append(None if step is None else (step.sequences, step.width, step.pass_seconds is not None))

    batch.add(BatchRequest(PROMPTS[0], SamplingParams(temperature=0.0), 6))
    batch.add(BatchRequest(PROMPTS[1], SamplingParams(temperature=0.0), 6))
    run()
    assert (2, 2, True) in seen and all(s is None or (s[1] == s[0] and s[2]) for s in seen)  # plain: a token each
    seen.clear()
    batch.add(BatchRequest([(5 * i + 1) % 60 for i in range(12)], SamplingParams(temperature=0.0), 3))
    run()
    assert seen[:2] == [None, None] and seen[-1] == (1, 1, True)  # its read's chunks ran no step


# ---- faults: what raises fails the sequences it concerns, and no other -------------------------------------------

class Planted(ModelDrafter):
    """A draft model's drafter whose `call`-th call of `method` (begin, propose, features or commit) raises."""

    def __init__(self, model: CausalLM, method: str, call: int) -> None:
        super().__init__(model)
        self.method, self.countdown = method, call
        self.needs_features = method == "features"  # only then is it handed the target's features

    def _planted(self, method: str) -> None:
        if method == self.method:
            self.countdown -= 1
            if self.countdown == 0:
                raise RuntimeError(f"planted {method} fault")

    def begin(self, prompt):
        self._planted("begin")
        super().begin(prompt)

    def features(self, hidden):
        self._planted("features")

    def propose_steps(self, ctx, k):  # raises once its draft passes have run: its draft rows are in
        draft = yield from super().propose_steps(ctx, k)
        self._planted("propose")
        return draft

    def commit(self, prev_len, path):
        self._planted("commit")
        super().commit(prev_len, path)


def run_checked(batch: BatchedDecoder) -> tuple[dict[int, list[int]], list[tuple[int, Exception]]]:
    """Step `batch` until it is empty: each sequence's tokens, and the sequences that failed. After every step the
    target's cache and each packed draft cache hold exactly the rows their `row_owner` names, none a failed one's."""
    tokens: dict[int, list[int]] = {}
    failed: list[tuple[int, Exception]] = []
    while batch.size:
        for ident, event in batch.step():
            tokens.setdefault(ident, []).extend(event.token_ids)
        failed += batch.take_failed()
        gone = {ident for ident, _ in failed}
        assert batch.target.cache_len == len(batch.row_owner) and not gone & set(batch.row_owner)
        for packed in batch._draft_caches.values():
            assert packed.lm.cache_len == len(packed.row_owner) and not gone & set(packed.row_owner)
    return tokens, failed


@pytest.mark.parametrize("method", ["begin", "propose", "features", "commit"])
def test_a_drafter_that_raises_fails_its_request_alone(tiny_target, drafts, make_lm, method):
    """A sequence whose drafter raises, as it joins (begin) or at a step (propose, features, commit), fails alone:
    it is in `take_failed()` with its error, its rows and draft rows leave, and the others (the next to join among
    them, one sharing its draft weights, one seeded sampled at a fixed k) answer as alone. Before, a failed begin
    dropped the next request waiting instead and left the failed one's rows; a fault at a step escaped it."""
    make = lambda: ModelDrafter(make_lm(drafts["close"], name="draft"))  # noqa: E731
    healthy = [BatchRequest(PROMPTS[0], SamplingParams(temperature=0.0), 20, make_drafter=make),
               BatchRequest(PROMPTS[2], SamplingParams(temperature=0.8, seed=3), 20, make_drafter=make, k=2)]
    expected = [SpeculativeDecoder(make_lm(tiny_target), make(), k=r.k or "auto").generate(
        r.prompt_ids, r.sampling, max_new_tokens=r.max_new_tokens).token_ids for r in healthy]
    batch = BatchedDecoder(make_lm(tiny_target), max_batch=3)
    planted = lambda: Planted(make_lm(drafts["close"], name="draft"), method, 1 if method == "begin" else 2)  # noqa
    broken = batch.add(BatchRequest(PROMPTS[4], SamplingParams(temperature=0.0), 20, make_drafter=planted, k=3))
    idents = [batch.add(request) for request in healthy]
    tokens, failed = run_checked(batch)
    assert [(ident, str(error)) for ident, error in failed] == [(broken, f"planted {method} fault")]
    assert [tokens.get(ident) for ident in idents] == expected
    assert batch.target.cache_len == 0 and not batch.row_owner and not batch._draft_caches


def test_a_target_pass_that_raises_part_way_fails_its_step_and_spares_the_waiting(tiny_target, drafts, make_lm,
                                                                                   monkeypatch):
    """A target pass that raises part-way (its first layer has written the pass's rows, its second raises) fails
    the sequences of that step with its error, and every layer of the cache goes back to the rows before the pass;
    a prompt being read meanwhile and a request waiting behind it answer as alone. Before, the error escaped the
    step, and the first layer kept the failed pass's rows."""
    from specdraft.models import causal_lm

    monkeypatch.setattr(causal_lm, "PREFILL_CHUNK", 4)
    monkeypatch.setattr("specdraft.batch_engine.PREFILL_CHUNK", 4)
    make = lambda: ModelDrafter(make_lm(drafts["close"], name="draft"))  # noqa: E731
    waiting = [BatchRequest([(7 * i + 3) % 60 for i in range(30)], SamplingParams(temperature=0.0), 12),
               BatchRequest(PROMPTS[4], SamplingParams(temperature=0.8, seed=5), 12, k=2)]
    expected = [SpeculativeDecoder(make_lm(tiny_target), make(), k=r.k or "auto").generate(
        r.prompt_ids, r.sampling, max_new_tokens=r.max_new_tokens).token_ids for r in waiting]
    batch = BatchedDecoder(make_lm(tiny_target), make, max_batch=4)
    running = [batch.add(BatchRequest(p, SamplingParams(temperature=0.0), 20)) for p in PROMPTS[:2]]
    batch.step()
    batch.step()
    idents = [batch.add(request) for request in waiting]
    state = {"in_pass": False, "fired": False}

    def second_layer(module, args):  # raises once, in the target's pass (the prompt reader shares the weights)
        if state["in_pass"] and not state["fired"]:
            state["fired"] = True
            raise RuntimeError("planted pass fault")

    forward = batch.target.forward

    def target_forward(*args, **kwargs):
        state["in_pass"] = True
        try:
            return forward(*args, **kwargs)
        finally:
            state["in_pass"] = False

    monkeypatch.setattr(batch.target, "forward", target_forward)
    hook = tiny_target.model.layers[1].register_forward_pre_hook(second_layer)
    try:
        assert batch.step() == []  # reads a chunk of the long prompt; the pass of the two running raises
    finally:
        hook.remove()
    assert state["fired"]
    assert sorted((ident, str(error)) for ident, error in batch.take_failed()) == [
        (ident, "planted pass fault") for ident in running]
    assert not batch.active and [joining.sequence.ident for joining in batch.joining] == idents
    assert batch.target.cache_len == len(batch.row_owner) == 0
    assert all(layer.get_seq_length() == 0 for layer in batch.target._cache.layers)
    tokens, failed = run_checked(batch)
    assert not failed and [tokens.get(ident) for ident in idents] == expected


def test_a_prefix_cache_that_raises_as_a_prompt_joins_fails_that_request_alone(tiny_target, make_lm, monkeypatch):
    """`PrefixCache.keep` raising once a joining prompt's rows are in the packed cache: that request fails, its rows
    leave with it, and the requests running and waiting behind it answer as alone. Before, its rows stayed with no
    owner, and the other sequences' masks were shifted against the cache."""
    from specdraft.prefix_cache import PrefixCache

    sampled = SamplingParams(temperature=0.9, seed=2)
    expected = [alone(make_lm(tiny_target), PROMPTS[0], 16), alone(make_lm(tiny_target), PROMPTS[5], 16, sampled)]
    batch = BatchedDecoder(make_lm(tiny_target), None, max_batch=3)
    batch.prefixes = PrefixCache(1 << 20)  # the float32 target keeps none by itself (not split-exact)
    keep, calls = batch.prefixes.keep, []

    def second_keep_raises(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("planted keep fault")
        return keep(*args, **kwargs)

    monkeypatch.setattr(batch.prefixes, "keep", second_keep_raises)
    first = batch.add(BatchRequest(PROMPTS[0], SamplingParams(temperature=0.0), 16))
    [(_, event)] = batch.step()
    broken = batch.add(BatchRequest(PROMPTS[2], SamplingParams(temperature=0.0), 16))
    after = batch.add(BatchRequest(PROMPTS[5], sampled, 16))  # shares no beginning with a kept prompt
    tokens, failed = run_checked(batch)
    assert [(ident, str(error)) for ident, error in failed] == [(broken, "planted keep fault")]
    assert [event.token_ids + tokens[first], tokens.get(after)] == expected
