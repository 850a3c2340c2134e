"""The `suffix` drafter: the counted trie, proposals, the bounded corpus, and exactness end to end."""

import random

import pytest
import torch

from specdraft import SamplingParams, SpecdraftError, SpeculativeDecoder
from specdraft.drafters.base import DraftContext
from specdraft.drafters.suffix import SuffixDrafter, SuffixIndex, SuffixTrie


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count; also checks each node's children total."""
    counts = {}

    def visit(node, path):
        children = node.children
        kids = [] if children is None else list(children.values()) if isinstance(children, dict) else [children]
        assert node.total == sum(child.count for child in kids)
        for child in kids:
            counts[path + (child.token,)] = child.count
            visit(child, path + (child.token,))

    visit(trie.root, ())
    return counts


def substring_counts(sequences, max_depth):
    """How often each substring of at most max_depth tokens occurs in the sequences (the trie's truth)."""
    counts = {}
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + max_depth) + 1):
                counts[tuple(seq[i:j])] = counts.get(tuple(seq[i:j]), 0) + 1
    return counts


def ctx_for(tokens):
    return DraftContext(torch.tensor(tokens, dtype=torch.long), SamplingParams(), torch.Generator(), None)


# -- the trie ------------------------------------------------------------------------------------
def test_trie_counts_every_window_up_to_max_depth():
    trie = SuffixTrie(max_depth=3)
    trie.insert([1, 2, 3, 1, 2, 4])
    counts = trie_counts(trie)
    assert counts[(1,)] == 2 and counts[(1, 2)] == 2 and counts[(1, 2, 3)] == 1 and counts[(1, 2, 4)] == 1
    assert counts[(2, 3, 1)] == 1 and (2, 3, 1, 2) not in counts  # depth-limited
    assert counts == substring_counts([[1, 2, 3, 1, 2, 4]], 3)
    assert trie.num_nodes == len(counts)


def test_trie_insert_and_remove_match_brute_force():
    rng = random.Random(0)
    sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    trie = SuffixTrie(max_depth=5)
    for seq in sequences:
        trie.insert(seq)
    assert trie_counts(trie) == substring_counts(sequences, 5)
    for seq in sequences[:5]:
        trie.remove(seq)
    assert trie_counts(trie) == substring_counts(sequences[5:], 5)
    assert trie.num_nodes == len(substring_counts(sequences[5:], 5))
    for seq in sequences[5:]:
        trie.remove(seq)
    assert trie.num_nodes == 0 and trie.root.children is None and trie.root.total == 0


# -- proposals -----------------------------------------------------------------------------------
def propose(tokens, limit=8, **options):
    index = SuffixIndex(max_depth=options.pop("max_depth", 24))
    index.start_request(tokens)
    return index.propose(limit, **options)


def test_longest_match_and_its_continuation():
    index = SuffixIndex(max_depth=8)
    index.start_request([5, 1, 2, 3, 9, 6, 1, 2])
    assert index.match_lengths() == (2, 0)  # "1 2" occurred before (followed by 3); no corpus yet
    proposal = index.propose(8, min_match=2, max_spec_factor=4.0)
    assert proposal.match_length == 2
    assert proposal.tokens == [3, 9, 6, 1, 2]  # what followed, as far as the depth allows (2 + 5 = 7 < 8)
    assert proposal.request_id is None


def test_continuation_is_the_most_frequent_child_then_the_most_recent():
    # Only "1 2" matches (the separators differ): 8 followed it twice, 7 once.
    proposal = propose([1, 2, 7, 5, 1, 2, 8, 6, 1, 2, 8, 4, 1, 2], limit=1)
    assert proposal.tokens == [8] and proposal.score == pytest.approx(2 / 3) and proposal.match_length == 2
    tied = propose([1, 2, 7, 5, 1, 2, 8, 6, 1, 2], limit=1)
    assert tied.tokens == [8]  # 7 and 8 followed once each: the later one wins
    # A longer match is more specific: after "0 1 2" only 8 ever came, so the draft is certain.
    certain = propose([1, 2, 7, 5, 1, 2, 8, 0, 1, 2, 8, 0, 1, 2], limit=1)
    assert certain.tokens == [8] and certain.score == 1.0 and certain.match_length >= 3  # ties: the longest


def test_no_self_match_without_continuation():
    """The tail is in the trie as the suffix at the end, but nothing followed it there."""
    index = SuffixIndex(max_depth=6)
    index.start_request([1, 2, 3, 4, 5, 6])
    assert index.match_lengths() == (0, 0)
    assert index.propose(8).tokens == []
    # A tail that repeats at the end still matches its earlier, continued occurrence.
    assert propose([7, 7, 7], max_spec_factor=3.0).tokens == [7]


def test_min_match():
    assert propose([1, 9, 2, 3, 1], min_match=1, max_spec_factor=2.0).tokens[:1] == [9]
    assert propose([1, 9, 2, 3, 1], min_match=2).tokens == []


def test_length_is_bounded_by_k_the_match_and_the_depth():
    periodic = [1, 2, 3, 4, 5] * 10
    for limit in range(1, 12):
        tokens = propose(periodic, limit=limit, max_spec_factor=8.0).tokens
        assert len(tokens) == limit  # a period repeats exactly: as many as allowed
        assert tokens == (periodic * 2)[len(periodic) % 5:][:limit]
    # A 2-token match with factor 1.5 drafts at most 3 tokens.
    proposal = propose([1, 2, 3, 4, 5, 6, 0, 1, 2], max_spec_factor=1.5)
    assert proposal.match_length == 2 and proposal.tokens == [3, 4, 5]
    # The depth caps match + draft: with max_depth 4 a 2-token match has 2 tokens below it.
    assert propose([1, 2, 3, 4, 5, 6, 0, 1, 2], max_depth=4, max_spec_factor=8.0).tokens == [3, 4]


def test_min_score_stops_at_an_uncertain_branch():
    # After "1 2" always came 3, then 4 or 5 equally often: a 50% step.
    seq = [1, 2, 3, 4, 0, 1, 2, 3, 5, 9, 1, 2]
    assert propose(seq, min_score=0.6, max_spec_factor=1.0).tokens == [3]
    lenient = propose(seq, min_score=0.4, max_spec_factor=1.0)
    assert lenient.tokens == [3, 5] and lenient.score == pytest.approx(1.5)  # ties: the most recent


# -- the corpus ----------------------------------------------------------------------------------
def test_lru_eviction_frees_nodes_and_forgets_the_request():
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]
    index = SuffixIndex(max_depth=4, max_requests=2)
    id_a, _ = index.finish_request(a), index.finish_request(b)
    index.touch(id_a)  # b is now the least recently used
    id_c = index.finish_request(c)
    assert list(index.requests) == [id_a, id_c]
    assert trie_counts(index.corpus) == substring_counts([a, c], 4)
    assert index.corpus.num_nodes == len(substring_counts([a, c], 4))
    index.start_request([0, 7, 8])
    assert index.propose(8).tokens == []  # b is forgotten
    index.start_request([0, 2, 3])
    assert index.propose(8).tokens == [4, 5]
    for request_id in list(index.requests):
        index.evict(request_id)
    assert index.corpus.num_nodes == 0 and not index.requests


def test_node_budget_evicts_and_bounds_one_request():
    index = SuffixIndex(max_depth=4, max_requests=64, max_nodes=40)
    index.finish_request(list(range(10)))  # 34 nodes
    index.finish_request(list(range(100, 110)))  # 68 in all: the older request goes
    assert len(index.requests) == 1 and index.corpus.num_nodes == 34
    index.finish_request(list(range(200, 300)))  # alone too big: only its last 40 // 4 tokens are kept
    assert len(index.requests) == 1 and index.corpus.num_nodes <= 40
    assert next(iter(index.requests.values())).tokens == list(range(290, 300))


def test_a_proposal_drawing_from_a_request_makes_it_recently_used():
    drafter = SuffixDrafter(max_requests=2)
    for first in (10, 20):
        drafter.begin(torch.tensor([first, first + 1]))
        drafter.end(torch.tensor([first, first + 1, first + 2, first + 3]))
    oldest = next(iter(drafter.index.requests))
    drafter.begin(torch.tensor([0, 10, 11]))
    draft = drafter.propose(ctx_for([0, 10, 11]), 4)
    assert draft.tokens.tolist() == [12, 13]
    drafter.end(torch.tensor([0, 10, 11, 12]))  # a third request: the one not drawn from is evicted
    assert oldest in drafter.index.requests and len(drafter.index.requests) == 2


def test_the_current_request_is_searchable_with_or_without_a_corpus():
    for max_requests in (0, 1):
        drafter = SuffixDrafter(max_requests=max_requests)
        drafter.begin(torch.tensor([40, 41, 42, 43]))
        drafter.end(torch.tensor([40, 41, 42, 43, 44]))
        seq = [1, 2, 3, 4, 1, 2]
        drafter.begin(torch.tensor(seq))
        assert drafter.source(ctx_for(seq)) == "suffix"
        assert drafter.propose(ctx_for(seq), 2).tokens.tolist() == [3, 4]


def test_memory_of_an_earlier_request():
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    later_prompt = [1, 2, 9, 10, 11]
    remembering = SuffixDrafter()
    remembering.begin(torch.tensor(first[:3]))
    remembering.end(torch.tensor(first))
    fresh = SuffixDrafter()
    for drafter in (remembering, fresh):
        drafter.begin(torch.tensor(later_prompt))
    assert fresh.source(ctx_for(later_prompt)) is None
    assert remembering.source(ctx_for(later_prompt)) == "suffix"
    assert remembering.propose(ctx_for(later_prompt), 3).tokens.tolist() == [12, 13, 14]


def test_drafters_sharing_a_memory_remember_each_others_requests_while_they_run():
    """Two drafters over one `SuffixMemory` (a server's sequences of one cache salt): a request that ends in one is
    drawn from by the other, which was live meanwhile (its matches in the corpus are made again), and a request
    evicted under it is matched no more."""
    from specdraft.drafters.suffix import SuffixMemory

    memory = SuffixMemory(max_requests=1)
    first, second = SuffixDrafter(memory=memory), SuffixDrafter(memory=memory)
    later = [1, 2, 9, 10, 11]
    second.begin(torch.tensor(later))
    assert second.source(ctx_for(later)) is None
    first.begin(torch.tensor([5, 6, 7]))
    first.end(torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14]))
    assert second.propose(ctx_for(later + [12]), 2).tokens.tolist() == [13, 14]
    first.begin(torch.tensor([30, 31]))
    first.end(torch.tensor([30, 31, 32, 33]))  # evicts the request drawn from
    assert len(memory.requests) == 1 and second.source(ctx_for(later + [12, 13])) is None


# -- the drafter interface -----------------------------------------------------------------------
def test_drafter_follows_the_sequence_with_or_without_source():
    drafter = SuffixDrafter()
    seq = [3, 4, 5, 6, 3, 4]
    drafter.begin(torch.tensor(seq[:2]))  # the index catches up from ctx.sequence
    draft = drafter.propose(ctx_for(seq), 8)  # no `source` first
    assert draft.tokens.tolist() == [5, 6, 3] and draft.q_draft is None
    assert draft.tokens.dtype == torch.long and draft.parents.tolist() == [-1, 0, 1]
    seq += [5, 6]
    assert drafter.source(ctx_for(seq)) == "suffix"
    assert drafter.source(ctx_for(seq), declined=frozenset({"suffix"})) is None
    assert drafter.propose(ctx_for(seq), 2).tokens.tolist() == [3, 4]  # never more than k
    assert drafter.propose(ctx_for(seq), 6).tokens.tolist() == [3, 4, 5, 6]  # k grew: recomputed
    # Without `begin` at all, the first sequence seen starts a request.
    assert SuffixDrafter().propose(ctx_for(seq), 8).k > 0


@pytest.mark.parametrize("options", [
    dict(max_depth=1), dict(max_depth=2.5), dict(min_match=0), dict(max_depth=4, min_match=4),
    dict(min_score=-0.1), dict(min_score=1.5), dict(max_spec_factor=0), dict(max_spec_factor=float("inf")),
    dict(max_requests=-1), dict(max_requests=True), dict(max_nodes=-5),
])
def test_bad_options_raise(options):
    with pytest.raises(SpecdraftError, match="suffix"):
        SuffixDrafter(**options)


# -- end to end ----------------------------------------------------------------------------------
REPEATING_PROMPT = [3, 9, 14, 27, 3, 9, 14, 27, 3, 9, 14, 27, 5, 3, 9]


def test_greedy_suffix_equals_ar_and_remembers(tiny_target, make_lm):
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(REPEATING_PROMPT, max_new_tokens=40)
    drafter = SuffixDrafter()
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=4)
    first = spec.generate(REPEATING_PROMPT, max_new_tokens=40)
    second = spec.generate(REPEATING_PROMPT, max_new_tokens=40)
    for got in (first, second):
        assert got.token_ids == expected.token_ids
        assert got.stats.new_tokens == 40 and got.finish_reason == "length"
    assert second.stats.drafted > 0 and second.stats.accepted > 0  # the first run is remembered
    assert second.stats.steps < 40
    stored = [request.tokens for request in drafter.index.requests.values()]
    assert stored == [REPEATING_PROMPT + expected.token_ids] * 2


def test_sampled_run_with_a_deterministic_draft(tiny_target, make_lm):
    drafter = SuffixDrafter()
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=4)
    params = SamplingParams(temperature=0.8, seed=3)
    drafted = 0
    for _ in range(2):
        got = spec.generate(REPEATING_PROMPT, params, max_new_tokens=40)
        assert len(got.token_ids) == 40 and got.finish_reason == "length"
        assert all(0 <= t < tiny_target.config.vocab_size for t in got.token_ids)
        drafted += got.stats.drafted
    assert drafted > 0  # drafts were verified as point masses (q_draft None)
