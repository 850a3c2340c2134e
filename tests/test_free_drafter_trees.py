"""Token trees from the free drafters (`ngram`, `suffix`): shape, sibling order, the chain case,
and greedy exactness through the engine."""

import dataclasses
import random
from collections import Counter

import pytest
import torch

from specdraft import SamplingParams, SpeculativeDecoder
from specdraft.drafters.base import DraftContext
from specdraft.drafters.ngram import NgramDrafter, NgramIndex
from specdraft.drafters.suffix import SuffixDrafter, SuffixIndex


def ctx(tokens, branch=1, max_depth=None):
    return DraftContext(torch.tensor(tokens, dtype=torch.long), SamplingParams(), torch.Generator(), None,
                        tree_branch=branch, max_depth=max_depth)


def depths(parents):
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def check_tree(tokens, parents, k, branch, depth):
    """Parents earlier (so ancestor-closed), <= branch children, <= k nodes, <= depth, no repeated sibling."""
    assert len(tokens) == len(parents) <= k
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert max(Counter(parents).values(), default=0) <= branch
    assert max(depths(parents), default=0) <= depth
    assert len(set(zip(parents, tokens))) == len(tokens)


def paths(tokens, parents):
    """The token path from the root to each node."""
    out = []
    for t, p in zip(tokens, parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def followed_a_match(seq, path, min_n):
    """Whether `path` occurred in `seq` right after an earlier occurrence of its last `min_n` tokens."""
    tail, m = tuple(seq[-min_n:]), len(path)
    return any(tuple(seq[i - min_n : i]) == tail and tuple(seq[i : i + m]) == path
               for i in range(min_n, len(seq)))


def random_sequences(count, length, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


# ----- ngram -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, branch, depth", [(1, 2, 1), (6, 2, 6), (12, 3, 4), (20, 4, 20)])
def test_ngram_tree_shape(k, branch, depth):
    trees = 0
    for seq in random_sequences(30, 60, 4, seed=k):
        index = NgramIndex(max_n=4, min_n=2)
        index.extend(seq)
        tokens, parents, _, n = index.lookup_tree(k, branch, depth)
        check_tree(tokens, parents, k, branch, depth)
        assert (n > 0) == bool(tokens) and n == index.lookup(1)[1]
        assert all(followed_a_match(seq, path, 2) for path in paths(tokens, parents))
        trees += max(Counter(parents).values(), default=0) > 1
    assert trees > 0 or k == 1  # a small vocabulary: tails have several continuations


def test_ngram_two_continuations_are_siblings_the_likelier_first():
    index = NgramIndex(max_n=3, min_n=2)
    index.extend([1, 2, 7, 0, 1, 2, 8, 5, 1, 2])  # "1 2" went on to 7, later to 8
    tokens, parents, _, n = index.lookup_tree(6, 2, 3)
    assert n == 2 and tokens[:2] == [8, 7] and parents[:2] == [-1, -1]  # equally often: the most recent first
    assert tokens == [8, 7, 5, 0, 1, 1] and parents == [-1, -1, 0, 1, 2, 3]
    index.extend([7, 3, 1, 2])  # now 7 twice, 8 once
    tokens, parents, scores, _ = index.lookup_tree(2, 2, 1)
    assert tokens == [7, 8] and parents == [-1, -1]  # more occurrences first
    assert scores == pytest.approx([2 / 3, 1 / 3])  # each node's share of the occurrences
    assert index.lookup(2) == ([7, 3], 2)  # the chain still follows the most recent occurrence


def test_ngram_longer_match_outweighs_a_shorter_one():
    # "0 1 2" was followed by 9 once; "1 2" alone by 4 twice more recently: the longer match's 9
    # gets the 3-gram's whole weight plus a share of the 2-gram's, so it comes first.
    index = NgramIndex(max_n=3, min_n=2)
    index.extend([0, 1, 2, 9, 5, 1, 2, 4, 6, 1, 2, 4, 0, 1, 2])
    tokens, parents, _, n = index.lookup_tree(2, 2, 1)
    assert n == 3 and tokens == [9, 4] and parents == [-1, -1]


def test_ngram_index_keeps_the_most_recent_starts():
    index = NgramIndex(max_n=2, min_n=2, keep=2)
    index.extend([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])
    assert index.follow[2][(1, 2)] == [5, 8]  # the last two continuation starts, oldest first
    assert index.lookup_tree(4, 4, 1)[0] == [5, 4]  # 3 is forgotten


def test_ngram_chain_unchanged_with_branch_one():
    for seq in random_sequences(20, 50, 5, seed=1):
        drafter = NgramDrafter(max_n=3, min_n=2)
        drafter.begin(torch.tensor(seq))
        draft = drafter.propose(ctx(seq, branch=1), 5)
        # reference: the continuation of the most recent earlier occurrence of the longest tail
        expected = []
        for n in (3, 2):
            starts = [i for i in range(n, len(seq)) if seq[i - n : i] == seq[-n:]]
            if starts:
                expected = seq[starts[-1] : starts[-1] + 5]
                break
        assert draft.tokens.tolist() == expected and draft.layout is None
        assert draft.parents.tolist() == list(range(-1, len(expected) - 1))


def test_ngram_drafter_tree_respects_max_depth():
    seq = [1, 2, 7, 0, 1, 2, 8, 5, 1, 2, 9, 6, 1, 2]
    drafter = NgramDrafter()
    draft = drafter.propose(ctx(seq, branch=3, max_depth=2), 8)
    assert draft.layout is not None and draft.q_draft is None
    check_tree(draft.tokens.tolist(), draft.parents.tolist(), 8, 3, 2)
    assert draft.tokens.tolist()[:3] == [9, 8, 7]  # one occurrence each: the most recent first
    assert draft.scores == pytest.approx([1 / 3] * 6)  # the scores travel with the draft, for `AutoK.trim`


# ----- suffix ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, branch, depth", [(1, 2, None), (6, 2, None), (12, 3, 3), (24, 4, None)])
def test_suffix_tree_shape_and_scores(k, branch, depth):
    trees = 0
    for seq in random_sequences(30, 60, 4, seed=k):
        index = SuffixIndex(max_depth=8)
        index.start_request(seq)
        proposal = index.propose_tree(k, branch, depth, min_match=2, min_score=0.05, max_spec_factor=2.0)
        tokens, parents = proposal.tokens, proposal.parents or []
        cap = min(int(2.0 * proposal.match_length), 8 - proposal.match_length, depth or k)
        check_tree(tokens, parents, k, branch, cap)
        assert all(followed_a_match(seq, path, 2) for path in paths(tokens, parents))
        if depth is None:  # the tree never scores less than the chain: the chain's nodes are candidates too
            assert proposal.score >= index.propose(k, 2, 0.05, 2.0).score - 1e-9
        trees += max(Counter(parents).values(), default=0) > 1
    assert trees > 0 or k == 1


def test_suffix_two_continuations_are_siblings_with_their_probabilities():
    index = SuffixIndex(max_depth=6)
    index.start_request([1, 2, 7, 5, 1, 2, 8, 6, 1, 2, 8, 4, 1, 2])  # after "1 2": 8 twice, 7 once
    tree = index.propose_tree(3, 2, min_score=0.0, max_spec_factor=1.0)
    assert tree.match_length == 2
    assert tree.tokens == [8, 7, 4] and tree.parents == [-1, -1, 0]  # 8 (2/3), 7 (1/3), then 8 -> 4 (1/3, newer)
    assert tree.scores == pytest.approx([2 / 3, 1 / 3, 1 / 3]) and tree.score == pytest.approx(4 / 3)
    tied = SuffixIndex(max_depth=6)
    tied.start_request([1, 2, 7, 5, 1, 2, 8, 6, 1, 2])
    assert tied.propose_tree(2, 2, max_spec_factor=1.0).tokens == [8, 7]  # equal counts: the most recent first


def test_suffix_tree_obeys_min_score_and_max_depth():
    seq = [1, 2, 3, 4, 0, 1, 2, 3, 5, 9, 1, 2, 3, 6, 8, 1, 2]  # after "1 2 3": 4, 5 or 6
    index = SuffixIndex(max_depth=24)
    index.start_request(seq)
    wide = index.propose_tree(8, 3, min_score=0.3, max_spec_factor=2.0)
    assert wide.tokens[:4] == [3, 6, 5, 4] and wide.parents[:4] == [-1, 0, 0, 0]
    assert index.propose_tree(8, 3, min_score=0.4, max_spec_factor=2.0).tokens == [3]  # 1/3 < 0.4
    assert index.propose_tree(8, 3, depth=1, min_score=0.0, max_spec_factor=2.0).tokens == [3]


def test_suffix_chain_unchanged_with_branch_one():
    for seq in random_sequences(20, 50, 4, seed=2):
        drafter = SuffixDrafter(max_depth=8)
        drafter.begin(torch.tensor(seq))
        draft = drafter.propose(ctx(seq, branch=1), 5)
        index = SuffixIndex(max_depth=8)
        index.start_request(seq)
        assert draft.tokens.tolist() == index.propose(5).tokens and draft.layout is None
        # and a tree of branch 1 is that same chain
        drafter_tree = drafter.propose(ctx(seq, branch=3), 5)
        assert drafter_tree.k <= 5
        assert index.propose_tree(5, 1).tokens == index.propose(5).tokens


def test_suffix_drafter_proposes_a_tree_from_the_corpus():
    drafter = SuffixDrafter()
    drafter.begin(torch.tensor([10, 11]))
    drafter.end(torch.tensor([10, 11, 12, 13, 10, 11, 14, 15]))
    seq = [0, 10, 11]
    drafter.begin(torch.tensor(seq))
    assert drafter.source(ctx(seq, branch=2)) == "suffix"
    draft = drafter.propose(ctx(seq, branch=2), 4)
    assert draft.tokens.tolist() == [14, 12, 15, 13] and draft.parents.tolist() == [-1, -1, 0, 1]
    assert draft.q_draft is None
    assert draft.scores == pytest.approx([0.5, 0.5, 0.5, 0.5])  # the scores travel with the draft, for `trim`
    assert drafter.propose(ctx(seq, branch=2), 3).scores == pytest.approx([0.5, 0.5, 0.5])


# ----- exactness through the engine ------------------------------------------------------------------
def branching(drafter_class, branch=3, max_depth=2):
    """A test-only drafter that asks for trees (`branch` children per node, at most `max_depth` deep)
    whatever the engine says, so its k nodes have room to branch."""
    class Branching(drafter_class):
        trees = 0

        def propose(self, ctx, k):
            draft = super().propose(dataclasses.replace(ctx, tree_branch=branch, max_depth=max_depth), k)
            self.trees += draft.layout is not None
            return draft

    return Branching()


def counting(drafter_class):
    """The drafter as the engine sets it up, counting the tree drafts it returns."""
    class Counting(drafter_class):
        trees = 0

        def propose(self, ctx, k):
            draft = super().propose(ctx, k)
            self.trees += draft.layout is not None
            return draft

    return Counting()


# After "1 2 3" came 4, 5 and 6: the first draft branches at the root.
PROMPTS = ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3], [7], list(range(10, 30)) * 2 + [10, 11])


@pytest.mark.parametrize("via", ["wrapper", "engine"])
@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("drafter_class", [NgramDrafter, SuffixDrafter])
def test_greedy_tree_equals_ar(tiny_target, make_lm, drafter_class, k, via):
    ar = SpeculativeDecoder(make_lm(tiny_target))
    if via == "wrapper":  # k nodes, the tree shape set by the drafter itself
        drafter = branching(drafter_class)
        spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=k)
    else:  # the engine's own tree options: 2k nodes, at most k deep
        drafter = counting(drafter_class)
        spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=k, tree_budget=2 * k, tree_branch=3)
    drafted = 0
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=30)
        got = spec.generate(prompt, max_new_tokens=30)
        assert got.token_ids == expected.token_ids
        drafted += got.stats.drafted
    assert drafted > 0 and drafter.trees > 0


def test_sampled_tree_run_completes(tiny_target, make_lm):
    spec = SpeculativeDecoder(make_lm(tiny_target), SuffixDrafter(), k=3, tree_budget=8, tree_branch=3)
    got = spec.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=3), max_new_tokens=20)
    assert len(got.token_ids) == 20 and all(0 <= t < tiny_target.config.vocab_size for t in got.token_ids)
