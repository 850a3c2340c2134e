"""Stopping (EOS, stop strings, budget) in the middle of a committed block, and streamed text."""

import pytest
from hypothesis import given, settings, strategies as st

from conftest import perturbed
from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder
from specdraft.text import IncrementalText

PROMPT = [5, 9, 2, 11, 3]


def _decoders(model, make_lm, tokenizer=None, k=4):
    """(ar, spec with an identical draft): the spec run commits k + 1 tokens per step."""
    ar = SpeculativeDecoder(make_lm(model, tokenizer))
    spec = SpeculativeDecoder(make_lm(model, tokenizer), ModelDrafter(make_lm(perturbed(model, 0.0, 0)), min_confidence=0.0), k=k)
    return ar, spec


def test_budget_cuts_the_block(tiny_target, make_lm):
    ar, spec = _decoders(tiny_target, make_lm, k=4)
    for budget in (1, 2, 5, 6, 13):
        a, s = ar.generate(PROMPT, max_new_tokens=budget), spec.generate(PROMPT, max_new_tokens=budget)
        assert s.token_ids == a.token_ids and len(s.token_ids) == budget
        assert s.stats.new_tokens == budget and s.finish_reason == "length"
        assert s.stats.accepted <= s.stats.drafted


def test_eos_in_the_middle_of_a_block(tiny_target, make_lm):
    ar, spec = _decoders(tiny_target, make_lm, k=4)
    free = ar.generate(PROMPT, max_new_tokens=30).token_ids
    # Pick as EOS a token that first appears inside a block (not at a block's end).
    position = next(i for i, t in enumerate(free) if free.index(t) == i and i % 5 not in (0, 4) and i > 3)
    eos = free[position]
    for decoder in (ar, spec):
        decoder.target.model.generation_config.eos_token_id = eos
    try:
        a, s = ar.generate(PROMPT, max_new_tokens=30), spec.generate(PROMPT, max_new_tokens=30)
    finally:
        for decoder in (ar, spec):
            decoder.target.model.generation_config.eos_token_id = None
    assert a.token_ids == free[: position + 1]
    assert s.token_ids == a.token_ids
    assert s.finish_reason == a.finish_reason == "stop"
    # Only what was emitted counts.
    assert s.stats.new_tokens == position + 1
    assert s.stats.accepted <= s.stats.new_tokens


@pytest.fixture()
def text_pair(tiny_model_dirs, tiny_tokenizer, make_lm):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["target"]).float().eval()
    model.generation_config.eos_token_id = None  # let it run to the budget
    return _decoders(model, make_lm, tiny_tokenizer, k=4)


def test_stop_string_mid_block(text_pair):
    ar, spec = text_pair
    full = ar.generate("def add", max_new_tokens=40, chat=False)
    text = full.text
    # A stop string from the middle of the output, free of replacement characters.
    start = next(i for i in range(len(text) // 3, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
    stop = text[start:start + 3]
    first = text.find(stop)
    for decoder in (ar, spec):
        got = decoder.generate("def add", max_new_tokens=40, stop=[stop], chat=False)
        assert got.finish_reason == "stop"
        assert got.text == text[:first]
        assert stop not in got.text
        assert got.token_ids == full.token_ids[: len(got.token_ids)]
        # The last kept token completes the stop string: one token fewer would not contain it.
        tok = decoder.target.tokenizer
        assert stop in tok.decode(got.token_ids, skip_special_tokens=True)
        assert stop not in tok.decode(got.token_ids[:-1], skip_special_tokens=True)
        assert got.stats.new_tokens == len(got.token_ids)


def test_streamed_text_equals_final_text(text_pair):
    ar, spec = text_pair
    for decoder in (ar, spec):
        events = list(decoder.stream("The quick", max_new_tokens=40, chat=False))
        streamed = "".join(e.text for e in events)
        tokens = [t for e in events for t in e.token_ids]
        assert streamed == decoder.target.tokenizer.decode(tokens, skip_special_tokens=True)
        assert all(len(e.pieces) == len(e.token_ids) == len(e.kinds) for e in events)
        assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])


def test_deltas_never_split_a_character(tiny_tokenizer):
    text = "Héllo ☃ 日本語 wörld"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    # The byte-level tokenizer splits some of these characters across tokens.
    assert any("\ufffd" in tiny_tokenizer.decode(ids[:j]) for j in range(1, len(ids)))
    inc = IncrementalText(tiny_tokenizer)
    pieces = []
    for j in range(len(ids)):
        texts, stopped = inc.token_texts(ids[:j], ids[j:j + 1])
        assert not stopped
        pieces.append(inc.delta(texts[0], final=j == len(ids) - 1))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_partial_stop_string_is_held_back(tiny_tokenizer):
    inc = IncrementalText(tiny_tokenizer, stops=["STOP"])
    assert inc.delta("abc ST", final=False) == "abc "
    assert inc.delta("abc STa", final=False) == "STa"
    texts, stopped = inc.token_texts(tiny_tokenizer("abc STa", add_special_tokens=False)["input_ids"],
                                     tiny_tokenizer(" STOP here", add_special_tokens=False)["input_ids"])
    assert stopped and texts[-1] == "abc STa "


def test_stop_string_beginning_before_an_unfinished_character_is_held_back():
    """Text "ab " then a half-decoded "п" (U+FFFD for now): with stop " п" the space is not emitted yet."""
    inc = IncrementalText(None, stops=[" \u043f"])
    assert inc.delta("ab \ufffd", final=False) == "ab"
    assert inc.delta("ab \u043fc", final=False) == " \u043fc"  # (the caller cuts at the stop before this)
    assert IncrementalText(None, stops=["xyz"]).delta("ab \ufffd", final=False) == "ab "


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab\ufffd", max_size=14), stops=st.lists(st.text("ab", min_size=1, max_size=9), min_size=1,
                                                              max_size=3))
def test_what_is_held_back_is_the_longest_stop_prefix_the_finished_text_ends_with(text, stops):
    """The KMP look-back (linear in a stop string's length) holds back what trying every prefix did: the longest
    proper prefix of a stop string that the text ends with, before its unfinished characters, and those."""
    finished = text.rstrip("\ufffd")
    overlap = max(n for stop in stops for n in range(min(len(stop) - 1, len(finished)) + 1)
                  if finished.endswith(stop[:n]))
    assert IncrementalText(None, stops=stops).delta(text, final=False) == text[: len(finished) - overlap]


def test_each_token_searches_only_where_a_stop_string_could_end(tiny_tokenizer, monkeypatch):
    """Stop strings are checked in linear time: each token's text is searched from the longest stop string's length
    less one before what it added, not from the step's beginning again (which searched a step's text k times)."""
    import specdraft.text as text_module

    searched, find = [], text_module.find_stop
    monkeypatch.setattr(text_module, "find_stop",
                        lambda text, stops, start=0: searched.append(len(text) - start) or find(text, stops, start))
    ids = tiny_tokenizer("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)["input_ids"]
    texts, stopped = IncrementalText(tiny_tokenizer, stops=["zebra", "dog!"]).token_texts([], ids)
    assert not stopped and len(searched) == len(ids) > 40
    widest = max(len(after) - len(before) for before, after in zip([""] + texts, texts))  # the most a token added
    assert max(searched) <= widest + len("zebra") - 1
    texts, stopped = IncrementalText(tiny_tokenizer, stops=["zebra", "dog."]).token_texts([], ids)
    assert stopped and texts[-1] == "The quick brown fox jumps over the lazy "  # still found where it begins


def test_sampled_run_stops_at_budget_and_counts(text_pair):
    _, spec = text_pair
    got = spec.generate("for i", SamplingParams(temperature=0.8, seed=3), max_new_tokens=17, chat=False)
    assert len(got.token_ids) == 17 == got.stats.new_tokens


@pytest.mark.parametrize("k,tree_budget,temperature", [(0, 0, 0.0), (4, 0, 0.0), (4, 6, 0.0), (3, 0, 0.8)])
def test_logprobs_are_the_targets_own_for_every_committed_token(tiny_target, drafts, make_lm, k, tree_budget,
                                                                temperature):
    """Whatever drafted, accepted or recovered a token, its log-probability is the target's full-forward
    one at that position (before temperature), and the alternatives are its top tokens, best first."""
    import torch

    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.0) if k else None
    decoder = SpeculativeDecoder(make_lm(tiny_target), drafter, k=k or 1, tree_budget=tree_budget, tree_branch=2)
    events = list(decoder.stream(PROMPT, SamplingParams(temperature=temperature, seed=3), max_new_tokens=20,
                                 logprobs=3))
    tokens = [t for e in events for t in e.token_ids]
    logprobs = [lp for e in events for lp in e.logprobs]
    top = [alts for e in events for alts in e.top_logprobs]
    assert len(tokens) == len(logprobs) == len(top) == 20
    with torch.no_grad():
        full = tiny_target(torch.tensor([PROMPT + tokens])).logits[0].float().log_softmax(-1)  # [L + 20, V]
    expected = full[len(PROMPT) - 1 : -1]  # [20, V]: the rows that predict each generated token
    torch.testing.assert_close(torch.tensor(logprobs), expected.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1),
                               atol=1e-4, rtol=1e-4)
    for row, alternatives in zip(expected, top):
        assert [token for token, _ in alternatives] == row.topk(3).indices.tolist()
    if temperature == 0:  # greedy: every token is the target's most likely one
        assert all(abs(lp - alts[0][1]) < 1e-6 for lp, alts in zip(logprobs, top))


def test_logprobs_out_of_range_are_refused(tiny_target, make_lm):
    from specdraft.errors import SpecdraftError

    with pytest.raises(SpecdraftError, match="logprobs must be between 0 and 20"):
        next(SpeculativeDecoder(make_lm(tiny_target)).stream(PROMPT, logprobs=21))
