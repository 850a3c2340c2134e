"""The `ngram` drafter (prompt lookup), composition (`ngram+model`) and the drafter registry."""

import pytest
import torch

from conftest import perturbed
from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.drafters import (ComposedDrafter, DraftContext, Drafter, NgramDrafter, check_drafter, make_drafter,
                                needs_draft_model)
from specdraft.drafters.ngram import NgramIndex
from specdraft.errors import SpecdraftError
from specdraft.policy import AutoK

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # the tail [5, 6] occurred twice before


def ctx(tokens: list[int]) -> DraftContext:
    return DraftContext(torch.tensor(tokens), SamplingParams(), torch.Generator(), None)


# ----- the index ---------------------------------------------------------------------------------
def test_lookup_takes_the_longest_tail_and_its_most_recent_occurrence():
    index = NgramIndex(max_n=3, min_n=1)
    index.extend([1, 2, 3, 9, 2, 3, 4, 1, 2, 3])
    # tail [1, 2, 3] occurred at 0..2 (followed by 9); [2, 3] last at 4..5 (followed by 4): the longer wins
    assert index.lookup(4) == ([9, 2, 3, 4], 3)
    index.extend([7])
    assert index.lookup(4) == ([], 0)  # 7 never occurred before
    index.extend([1])  # tail [7, 1]: only [1] matches, most recently at 7 (followed by 2)
    assert index.lookup(2) == ([2, 3], 1)


def test_no_match_with_itself_and_min_n_respected():
    index = NgramIndex(max_n=3, min_n=2)
    index.extend([4, 5, 6])
    assert index.lookup(3) == ([], 0)  # the tail's only occurrence is the tail
    index.extend([1, 6])  # [1, 6] is new; [6] alone would match but is below min_n
    assert index.lookup(3) == ([], 0)


def test_incremental_index_equals_one_built_at_once():
    tokens = torch.randint(0, 6, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    whole, pieces = NgramIndex(4, 1), NgramIndex(4, 1)
    whole.extend(tokens)
    for start in range(0, 200, 7):
        pieces.extend(tokens[start : start + 7])
    assert whole.follow == pieces.follow and whole.lookup(5) == pieces.lookup(5)


def test_drafter_offers_only_with_a_match_and_never_more_than_k():
    drafter = NgramDrafter(max_n=3, min_n=2)
    drafter.begin(torch.tensor(REPEATING[:5]))
    assert drafter.source(ctx(REPEATING[:5])) is None
    assert drafter.source(ctx(REPEATING)) == "ngram"  # the sequence grew by committed tokens
    draft = drafter.propose(ctx(REPEATING), 2)
    assert draft.tokens.tolist() == [7, 8] and draft.q_draft is None and draft.parents.tolist() == [-1, 0]
    assert drafter.source(ctx(REPEATING), declined=frozenset({"ngram"})) is None


@pytest.mark.parametrize("max_n, min_n", [(0, 0), (2, 3), (3, 0)])
def test_bad_sizes_are_refused(max_n, min_n):
    with pytest.raises(SpecdraftError, match="ngram-min"):
        NgramDrafter(max_n=max_n, min_n=min_n)


# ----- exactness through the engine ----------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
@pytest.mark.parametrize("name", ["ngram", "ngram+model"])
def test_greedy_equals_ar(tiny_target, make_lm, name, k):
    ar = SpeculativeDecoder(make_lm(tiny_target))
    drafter = make_drafter(name, draft_model=make_lm(perturbed(tiny_target, noise=0.3, seed=1)))
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=k)
    drafted = 0
    for prompt in (REPEATING, [7], list(range(10, 40)) * 2):
        expected = ar.generate(prompt, max_new_tokens=40)
        got = spec.generate(prompt, max_new_tokens=40)
        assert got.token_ids == expected.token_ids
        drafted += got.stats.drafted
    assert drafted > 0


def test_sampled_run_is_reproducible(tiny_target, make_lm):
    spec = SpeculativeDecoder(make_lm(tiny_target), make_drafter("ngram"), k=4)
    params = SamplingParams(temperature=0.8, seed=5)
    a, b = spec.generate(REPEATING, params, max_new_tokens=30), spec.generate(REPEATING, params, max_new_tokens=30)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30


def test_composition_records_who_drafted(tiny_target, make_lm):
    drafter = make_drafter("ngram+model", draft_model=make_lm(perturbed(tiny_target, noise=0.3, seed=1)))
    assert isinstance(drafter, ComposedDrafter) and drafter.name == "ngram+model"
    stats = SpeculativeDecoder(make_lm(tiny_target), drafter, k=3).generate(REPEATING, max_new_tokens=40).stats
    by_source = stats.by_source()
    assert by_source["ngram"]["drafted"] > 0 and by_source["model"]["drafted"] > 0
    assert sum(row["steps"] for row in by_source.values()) == stats.steps
    assert sum(row["accepted"] for row in by_source.values()) == stats.accepted
    assert stats.to_dict()["by_source"] == by_source


def test_a_declined_source_hands_the_step_to_the_fallback(tiny_target, make_lm):
    """The policy prices each source apart: a poor ngram record sends the step to the model."""
    policy = AutoK()
    policy.verify_seconds = [None, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    ngram = policy.estimates("ngram")
    ngram.hits, ngram.tries, ngram.draft_seconds_per_token = [0.0] * 8, [1000.0] * 8, 0.0
    model = policy.estimates("model")
    model.hits, model.tries, model.draft_seconds_per_token = [900.0] * 8, [1000.0] * 8, 0.001
    policy.observe = lambda *args, **kwargs: None  # keep the estimates as set
    drafter = make_drafter("ngram+model", draft_model=make_lm(perturbed(tiny_target, noise=0.3, seed=1)))
    stats = SpeculativeDecoder(make_lm(tiny_target), drafter, k=policy).generate(REPEATING, max_new_tokens=12).stats
    assert "ngram" not in stats.by_source() and stats.by_source()["model"]["drafted"] > 0


def test_end_sees_the_whole_sequence_even_when_the_stream_stops_early(tiny_target, make_lm):
    class Recorder(NgramDrafter):
        ended: list[list[int]] = []

        def end(self, sequence):
            self.ended.append(sequence.tolist())

    drafter = Recorder()
    decoder = SpeculativeDecoder(make_lm(tiny_target), drafter, k=2)
    full = decoder.generate(REPEATING, max_new_tokens=10)
    assert drafter.ended[-1] == REPEATING + full.token_ids
    stream = decoder.stream(REPEATING, max_new_tokens=10)
    first = next(stream)
    stream.close()  # a consumer that stops (e.g. a client that went away)
    assert drafter.ended[-1] == REPEATING + first.token_ids


# ----- the registry ----------------------------------------------------------------------------------
def test_registry_names_options_and_errors():
    assert not needs_draft_model("ngram") and needs_draft_model("ngram+model") and not needs_draft_model("early-exit")
    assert check_drafter("ngram", {"ngram-max": 6, "draft-confidence": None}) == {"ngram-max": 6, "ngram-min": 2}
    with pytest.raises(SpecdraftError, match="Unknown drafter 'nope'"):
        check_drafter("ngram+nope")
    with pytest.raises(SpecdraftError, match="twice"):
        check_drafter("ngram+ngram")
    with pytest.raises(SpecdraftError, match="takes no option exit-layer"):
        check_drafter("ngram", {"exit-layer": 3})
    with pytest.raises(SpecdraftError, match="needs a draft model"):
        make_drafter("model")
    assert isinstance(make_drafter("ngram", {"ngram-min": 1}), Drafter)
