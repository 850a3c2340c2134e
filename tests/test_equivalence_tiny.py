"""Tier 3 on tiny random models: greedy speculative output equals plain decoding, for several k."""

import copy

import pytest
import torch

from registered_drafters import build, registered
from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder

PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(10, 40))]


@pytest.mark.parametrize("confidence", [0.0, 0.5])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("draft_name", ["identical", "close", "far", "independent"])
def test_greedy_spec_equals_ar(tiny_target, drafts, make_lm, k, draft_name, confidence):
    target = make_lm(tiny_target)
    ar = SpeculativeDecoder(target)
    drafter = ModelDrafter(make_lm(drafts[draft_name]), min_confidence=confidence)
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=k)
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=40)
        got = spec.generate(prompt, max_new_tokens=40)
        assert got.token_ids == expected.token_ids
        assert got.stats.new_tokens == 40 and got.finish_reason == "length"
        assert got.stats.drafted > 0


@pytest.mark.parametrize("name", registered())
def test_every_registered_drafter_is_exact_greedy(tiny_target, drafts, make_lm, name):
    """Every drafter of the registry (a new one included, with no edit here), fixed k and auto."""
    expected = [SpeculativeDecoder(make_lm(tiny_target)).generate(p, max_new_tokens=30).token_ids for p in PROMPTS]
    target = make_lm(tiny_target)
    drafter = build(name, target, make_lm(drafts["close"]))
    for k in (3, "auto"):
        spec = SpeculativeDecoder(target, drafter, k=k)
        outs = [spec.generate(prompt, max_new_tokens=30) for prompt in PROMPTS]
        assert [out.token_ids for out in outs] == expected, (name, k)
        assert k == "auto" or sum(out.stats.drafted for out in outs) > 0, name


def test_acceptance_tracks_draft_quality(tiny_target, drafts, make_lm):
    rates = {}
    for name in ("identical", "close", "independent"):
        spec = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts[name]), min_confidence=0.0), k=4)
        stats = spec.generate(PROMPTS[0], max_new_tokens=40).stats
        rates[name] = stats.acceptance_rate
        assert stats.mean_committed_per_step == pytest.approx(stats.new_tokens / stats.steps)
        assert sum(stats.accepted_at) == stats.accepted
        assert sum(stats.drafted_at) == stats.drafted
    assert rates["identical"] == 1.0
    assert rates["identical"] > rates["close"] > rates["independent"]


def test_full_acceptance_commits_k_plus_one(tiny_target, drafts, make_lm):
    """An identical draft is always accepted: every step commits k + 1 (the last one is the bonus)."""
    spec = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts["identical"]), min_confidence=0.0), k=3)
    events = list(spec.stream(PROMPTS[0], max_new_tokens=21))
    assert [len(e.token_ids) for e in events] == [4] * 5 + [1]
    assert events[0].kinds == ["accepted"] * 3 + ["bonus"]
    assert events[-1].kinds == ["target"]  # the budget left room for no draft


def test_caches_follow_the_committed_sequence(tiny_target, drafts, make_lm):
    """After each step both caches hold exactly the committed sequence minus its last token."""
    target, draft = make_lm(tiny_target), make_lm(drafts["close"])
    spec = SpeculativeDecoder(target, ModelDrafter(draft), k=4)
    length = len(PROMPTS[2])
    for event in spec.stream(PROMPTS[2], max_new_tokens=30):
        length += len(event.token_ids)
        if event.finish_reason is None:
            assert target.cache_len == length - 1
            assert draft.cache_len <= length - 1


@pytest.mark.parametrize("settings", [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
])
def test_greedy_with_repetition_penalty_equals_ar(tiny_target, drafts, make_lm, settings):
    params = SamplingParams(**settings)
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[0], params, max_new_tokens=40)
    for name in ("identical", "close"):
        spec = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts[name])), k=4)
        got = spec.generate(PROMPTS[0], params, max_new_tokens=40)
        assert got.token_ids == expected.token_ids
    # The penalty changes the output (else this test would prove nothing).
    plain = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[0], max_new_tokens=40)
    assert plain.token_ids != expected.token_ids


def test_sampling_is_reproducible_and_seed_dependent(tiny_target, drafts, make_lm):
    def run(seed):
        spec = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts["close"])), k=3)
        return spec.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.95, seed=seed), 30).token_ids
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_identical_draft_with_sampling_accepts_everything(tiny_target, drafts, make_lm):
    """p == q: every draft token is accepted with probability 1."""
    spec = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(make_lm(drafts["identical"]), min_confidence=0.0), k=4)
    stats = spec.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_k=20, seed=5), 30).stats
    assert stats.acceptance_rate == 1.0


def test_int4_draft_stays_exact(tiny_target, drafts, make_lm):
    """A quantized draft proposes differently but the output is still the target's."""
    from specdraft.models.loading import prepare_draft

    draft = make_lm(drafts["close"])
    quantized = prepare_draft(draft, "int4", copy=True)
    assert quantized.model is not draft.model  # the copy leaves the loaded draft as it was
    assert any(type(m).__name__ == "Int4Linear" for m in quantized.model.modules())
    assert not any(type(m).__name__ == "Int4Linear" for m in draft.model.modules())
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[2], max_new_tokens=40)
    got = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(quantized), k=4).generate(PROMPTS[2], max_new_tokens=40)
    assert got.token_ids == expected.token_ids and got.stats.accepted > 0


def test_int4_linear_matches_its_float_weights():
    from torch import nn

    from specdraft.models.quantize import Int4Linear

    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True)
    x = torch.randn(3, 128)
    ref = linear(x)
    err = (Int4Linear.quantize(linear)(x) - ref).norm() / ref.norm()
    assert err < 0.1  # 4-bit groups of 32: close, not equal (a wrong packing gives ~1)
    assert err > 0  # and really quantized


def test_confidence_stop_shortens_drafts_and_stays_exact(tiny_target, drafts, make_lm):
    """A draft unsure of its chain stops early: fewer tokens drafted per step, same output."""
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[0], max_new_tokens=40)
    per_step = {}
    for confidence in (0.0, 0.9):
        drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=confidence)
        got = SpeculativeDecoder(make_lm(tiny_target), drafter, k=6).generate(PROMPTS[0], max_new_tokens=40)
        assert got.token_ids == expected.token_ids
        per_step[confidence] = got.stats.drafted / got.stats.steps
    assert per_step[0.0] > 5 and per_step[0.9] < per_step[0.0]


def test_confidence_must_be_a_probability():
    from specdraft.errors import SpecdraftError

    with pytest.raises(SpecdraftError):
        ModelDrafter(None, min_confidence=1.0)


def test_int4_linear_uses_the_dense_weight_for_wide_passes():
    from torch import nn

    from specdraft.models.quantize import PASS_WIDTH, Int4Linear

    torch.manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    quantized = Int4Linear.quantize(linear, keep_dense=True)
    wide = torch.randn(PASS_WIDTH + 1, 64)
    assert torch.equal(quantized(wide), linear(wide))  # prefill: the exact dense weight
    narrow = torch.randn(2, 64)
    assert not torch.equal(quantized(narrow), linear(narrow))  # decode: the int4 kernel


def test_narrowed_draft_vocab_stays_exact(tiny_target, drafts, make_lm):
    """A draft head over part of the vocabulary only proposes from it; greedy output is the target's."""
    from specdraft.models.draft_head import SubsetHead
    from specdraft.models.loading import prepare_draft

    draft = make_lm(drafts["close"])
    narrowed = prepare_draft(draft, "none", copy=True, vocab=40)
    head = narrowed.model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and narrowed.vocab_size == draft.vocab_size
    logits = narrowed.forward(torch.tensor([PROMPTS[0]]), logits_to_keep=1).logits[0, -1]  # [V]
    assert len(head.ids) == 48 and head.ids.tolist() == list(range(48))  # rounded up to the kernels' 16 rows
    assert torch.isinf(logits[48:]).all() and torch.isfinite(logits[:48]).all()
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[0], max_new_tokens=40)
    got = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(narrowed), k=4).generate(PROMPTS[0], max_new_tokens=40)
    assert got.token_ids == expected.token_ids
    sampled = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(prepare_draft(draft, "int4", copy=True, vocab=40)), k=4)
    out = sampled.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, seed=3), max_new_tokens=30)
    assert len(out.token_ids) == 30 and out.stats.drafted > 0


def test_draft_vocab_ranked_by_counts_stays_exact(tiny_target, drafts, make_lm):
    """With token counts, half the narrowed head is the most frequent tokens (high ids included), the rest
    the lowest ids; greedy output is still the target's."""
    from specdraft.models.draft_head import restrict_draft_vocab

    draft = make_lm(copy.deepcopy(drafts["close"]))
    vocab = draft.vocab_size
    counts = torch.zeros(vocab - 3, dtype=torch.long)  # a tokenizer's vocabulary may stop short of the head's rows
    frequent = [vocab - 4, vocab - 10, 45, 40]
    counts[frequent] = torch.tensor([50, 40, 30, 20])
    assert restrict_draft_vocab(draft, 24, counts) == 32  # rounded up to the kernels' 16 rows
    ids = draft.model.get_output_embeddings().ids.tolist()
    assert set(frequent) <= set(ids) and set(range(20)) <= set(ids) and max(set(ids) - set(frequent)) < 32
    plain = make_lm(copy.deepcopy(drafts["close"]))
    assert restrict_draft_vocab(plain, 24, torch.zeros(vocab, dtype=torch.long)) == 32
    assert plain.model.get_output_embeddings().ids.tolist() == list(range(32))  # no counts: the lowest ids
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[1], max_new_tokens=40)
    got = SpeculativeDecoder(make_lm(tiny_target), ModelDrafter(draft), k=4).generate(PROMPTS[1], max_new_tokens=40)
    assert got.token_ids == expected.token_ids


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("context", [1, 8, 29, 30, 0])
def test_draft_context_window_stays_exact(tiny_target, drafts, make_lm, context, tree):
    """A draft that reads only the prompt's last `context` tokens (positions counted from there) drafts
    from what it read; the output still equals plain decoding, chains and trees alike."""
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[2], max_new_tokens=30).token_ids
    draft = make_lm(drafts["identical"])
    drafter = ModelDrafter(draft, min_confidence=0.0, context=context)
    options = dict(tree_budget=8, tree_branch=2) if tree else {}
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=3, **options)
    length, first = len(PROMPTS[2]), True
    for event in spec.stream(PROMPTS[2], max_new_tokens=30):
        if first:  # the first draft read at most `context` prompt tokens (+ the draft tokens it fed)
            assert draft.cache_len <= (context or length) + 3
            first = False
        length += len(event.token_ids)
    got = spec.generate(PROMPTS[2], max_new_tokens=30)
    assert got.token_ids == expected and got.stats.drafted > 0


def test_draft_context_prices_only_the_window(tiny_target, drafts, make_lm):
    """`unread` (what k=auto charges for the draft's catch-up) counts the window, not the whole prompt."""
    from specdraft.drafters.base import DraftContext

    drafter = ModelDrafter(make_lm(drafts["close"]), context=8, catch_up=0)
    drafter.begin(torch.tensor(PROMPTS[2]))
    ctx = DraftContext(torch.tensor(PROMPTS[2]), SamplingParams(), torch.Generator(), None)
    assert drafter.unread(ctx) == 8
    drafter.propose(ctx, 2)
    grown = DraftContext(torch.tensor(PROMPTS[2] + [5, 6]), SamplingParams(), torch.Generator(), None)
    drafter.commit(len(PROMPTS[2]), [])  # nothing accepted: the draft keeps the window only
    assert drafter.unread(grown) == 2
    # after a run of plain steps the draft starts over from the last 8 tokens instead of reading them all
    long = DraftContext(torch.tensor(PROMPTS[2] + list(range(3, 23))), SamplingParams(), torch.Generator(), None)
    assert drafter.unread(long) == 8
    drafter.propose(long, 2)
    assert drafter.model.cache_len == 8 + 1  # the window and the one draft token fed
    drafter.commit(len(long.sequence), [0, 1])
    assert drafter.unread(DraftContext(torch.cat([long.sequence, torch.tensor([4, 5, 6])]), SamplingParams(),
                                       torch.Generator(), None)) == 2  # the window's draft token was kept
    with pytest.raises(Exception, match="draft-context"):
        ModelDrafter(make_lm(drafts["close"]), context=-1)


def test_a_long_catch_up_reads_only_the_last_tokens_after_what_the_draft_holds(tiny_target, drafts, make_lm):
    """With `catch_up`, a catch-up after a run of plain steps keeps the draft's cache and reads only the last
    `catch_up` tokens it missed (a splice): `unread`, what k=auto charges, counts them alone."""
    from specdraft.drafters.base import DraftContext

    def context(tokens: list[int]) -> DraftContext:
        return DraftContext(torch.tensor(tokens), SamplingParams(), torch.Generator(), None)

    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.0, context=8, catch_up=4)
    drafter.begin(torch.tensor(PROMPTS[2]))
    assert drafter.unread(context(PROMPTS[2])) == 8  # a first read: the window
    drafter.propose(context(PROMPTS[2]), 2)
    drafter.commit(len(PROMPTS[2]), [])  # nothing accepted: the window kept
    assert drafter.unread(context(PROMPTS[2] + [5, 6, 7])) == 3  # a short catch-up reads all it missed
    long = PROMPTS[2] + list(range(3, 23))
    assert drafter.unread(context(long)) == 4
    drafter.propose(context(long), 2)
    assert drafter.model.cache_len == 8 + 4 + 1  # the window kept, the last 4 tokens, the one draft token fed
    drafter.commit(len(long), [0, 1])
    assert drafter.unread(context(long + [4, 5, 6])) == 2  # positions after the splice line up: its draft token kept
    assert ModelDrafter(make_lm(drafts["close"]), context=8, catch_up=30).unread(context(long)) == 8  # the window caps
    with pytest.raises(Exception, match="draft-catch-up"):
        ModelDrafter(make_lm(drafts["close"]), catch_up=-1)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("catch_up", [1, 2])
def test_spliced_catch_ups_stay_exact(tiny_target, drafts, make_lm, catch_up, tree):
    """A draft that reads only the last 1-2 tokens of each catch-up (a splice nearly every step) drafts from what it
    read; the output still equals plain decoding, chains and trees alike."""
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[2], max_new_tokens=30).token_ids
    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.0, context=8, catch_up=catch_up)
    options = dict(tree_budget=8, tree_branch=2) if tree else {}
    got = SpeculativeDecoder(make_lm(tiny_target), drafter, k=3, **options).generate(PROMPTS[2], max_new_tokens=30)
    assert got.token_ids == expected and got.stats.accepted > 0



@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("context,catch_up", [(0, 0), (16, 16), (8, 4)])
def test_a_draft_shorter_than_the_sequence_drafts_on_within_its_positions(tiny_target, drafts, make_lm, context,
                                                                          catch_up, tree):
    """A draft that holds 48 positions (`hold_context`: less than the target's 256) under a sequence that grows to 90:
    its reads start over within its positions, nothing raises, and it still drafts past position 48, alone and in a
    batch; the output equals plain decoding, chains and trees alike."""
    from specdraft.batch_engine import BatchedDecoder, BatchRequest
    from specdraft.models.context import hold_context

    draft_model = copy.deepcopy(drafts["close"])  # a config of its own: the target keeps its 256 positions
    assert hold_context(draft_model, 48, "draft") == "context 48"
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[2], max_new_tokens=60).token_ids
    options = dict(tree_budget=8, tree_branch=2) if tree else {}

    def drafter() -> ModelDrafter:
        return ModelDrafter(make_lm(draft_model, name="draft"), min_confidence=0.0, context=context,
                            catch_up=catch_up)

    spec = SpeculativeDecoder(make_lm(tiny_target), drafter(), k=3, **options)
    assert spec.target.max_context == 256 and spec.drafter.model.max_context == 48
    length, drafted_past = len(PROMPTS[2]), 0
    got = []
    for event in spec.stream(PROMPTS[2], max_new_tokens=60):
        drafted_past += event.drafted if length > 48 else 0
        length += len(event.token_ids)
        got += event.token_ids
    assert got == expected and drafted_past > 0
    batch = BatchedDecoder(make_lm(tiny_target), drafter, max_batch=2, **options)
    answers = batch.generate_all([BatchRequest(PROMPTS[2], SamplingParams(temperature=0.0), 60),
                                  BatchRequest(PROMPTS[0], SamplingParams(temperature=0.0), 60)])
    assert answers[0].token_ids == expected and answers[0].stats.drafted > 0
    assert answers[1].token_ids == SpeculativeDecoder(make_lm(tiny_target)).generate(
        PROMPTS[0], max_new_tokens=60).token_ids

def test_draft_vocab_auto_narrows_only_a_large_counted_head_on_the_cpu(tiny_target, drafts, make_lm, monkeypatch):
    """`--draft-vocab auto` (the default): AUTO_DRAFT_VOCAB tokens on the CPU where token counts exist for the
    draft's tokenizer and the vocabulary is larger; the whole vocabulary otherwise; numbers are taken as given."""
    from specdraft.errors import SpecdraftError
    from specdraft.models import draft_head
    from specdraft.models.draft_head import AUTO_DRAFT_VOCAB, draft_vocab_value, resolved_draft_vocab
    from specdraft.models.loading import prepare_draft

    assert draft_vocab_value("auto") == draft_vocab_value(" AUTO ") == "auto"
    assert draft_vocab_value("0") == 0 and draft_vocab_value(32768) == 32768
    for bad in ("-1", "lots", "1.5"):
        with pytest.raises(SpecdraftError, match="--draft-vocab"):
            draft_vocab_value(bad)
    draft = make_lm(drafts["close"])  # a tiny vocabulary: nothing to narrow
    assert resolved_draft_vocab("auto", draft, counted=True) == 0
    assert resolved_draft_vocab(40, draft, counted=False) == 40
    monkeypatch.setattr(draft_head, "AUTO_DRAFT_VOCAB", 40)  # as if the tiny vocabulary were a large one
    assert resolved_draft_vocab("auto", draft, counted=True) == 40
    assert resolved_draft_vocab("auto", draft, counted=False) == 0  # no counts: lowest ids would be a poor guess
    assert prepare_draft(draft, "none", copy=True) is draft  # the tiny tokenizer has no counts: left as it was
    assert AUTO_DRAFT_VOCAB == 32768
