"""A packed cache (`models.packed_cache`): many owners' rows in one cache, each seeing only its own, so a batch's
draft models run a depth's tokens in one pass."""

from __future__ import annotations

import pytest
import torch

from specdraft.models.packed_cache import DEAD, PackedCache

A, B = [5, 17, 42, 8, 59, 3], [7, 7, 1, 30, 2]


def alone(make_lm, model, tokens: list[int]) -> torch.Tensor:
    """The logits after each token, fed one at a time into a cache of its own. # [T, V]"""
    lm = make_lm(model)
    return torch.cat([lm.forward(torch.tensor([[t]])).logits[0] for t in tokens])


def test_owners_in_one_pass_get_what_each_gets_alone(tiny_target, make_lm):
    expected = {0: alone(make_lm, tiny_target, A), 1: alone(make_lm, tiny_target, B)}
    packed = PackedCache(make_lm(tiny_target))
    got = {0: [], 1: []}
    for step in range(max(len(A), len(B))):  # two owners, a token each a pass, interleaved in one cache
        feeds = [(owner, torch.tensor([seq[step]])) for owner, seq in ((0, A), (1, B)) if step < len(seq)]
        for (owner, _), logits in zip(feeds, packed.run(feeds)):
            got[owner].append(logits)
    for owner in (0, 1):
        torch.testing.assert_close(torch.cat(got[owner]), expected[owner], rtol=1e-4, atol=1e-4)
    assert packed.live(0) == len(A) and packed.live(1) == len(B) == packed.lm.cache_len - len(A)


def test_a_feed_of_several_tokens_and_a_cut_back_are_seen_as_alone(tiny_target, make_lm):
    packed = PackedCache(make_lm(tiny_target))
    first, second = packed.view(0), packed.view(1)
    first.forward(torch.tensor([A[:4]]))
    second.forward(torch.tensor([B[:3]]))
    first.forward(torch.tensor([[63, 62]]))  # drafts, then rejected
    first.truncate(4)
    assert first.cache_len == 4 and packed.lm.cache_len == 9  # cut rows stay until compacted, unseen
    [after_cut] = packed.run([(0, torch.tensor(A[4:]))])
    torch.testing.assert_close(after_cut[0], alone(make_lm, tiny_target, A)[-1], rtol=1e-4, atol=1e-4)
    packed.compact()
    assert packed.lm.cache_len == len(A) + 3 and packed.row_owner.count(0) == len(A)
    [b_next, a_next] = packed.run([(1, torch.tensor(B[3:])), (0, torch.tensor([11]))])  # the longer feed first
    torch.testing.assert_close(b_next[0], alone(make_lm, tiny_target, B)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a_next[0], alone(make_lm, tiny_target, A + [11])[-1], rtol=1e-4, atol=1e-4)
    packed.release(0)
    packed.release(1)
    packed.compact()
    assert packed.lm.cache_len == 0 and not packed.row_owner


def test_a_tree_pass_and_what_it_keeps_are_seen_as_alone(tiny_target, make_lm):
    """A draft model's tree over a packed cache (`CacheView.forward` with offsets and a mask, then `keep`): the
    logits it gets alone, the other owner's rows unseen, and after the keep the path's rows as alone."""
    lone = make_lm(tiny_target)
    packed = PackedCache(make_lm(tiny_target))
    mine, other = packed.view(0), packed.view(1)
    lone.forward(torch.tensor([A[:4]]))
    mine.forward(torch.tensor([A[:4]]))
    other.forward(torch.tensor([B[:3]]))
    level = torch.tensor([[63, 62]]), torch.tensor([0, 0]), torch.eye(2, dtype=torch.bool)  # two children of A[3]
    below = torch.tensor([[61]]), torch.tensor([-1]), torch.tensor([[True, False, True]])  # 61 under 63
    for tokens, offsets, visible in (level, below):
        expected = lone.forward(tokens, tokens.shape[1], offsets=offsets, visible=visible).logits[0]
        got = mine.forward(tokens, tokens.shape[1], offsets=offsets, visible=visible).logits[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    lone.keep(4, [0, 2])  # the path 63 -> 61
    mine.keep(4, [0, 2])
    assert mine.cache_len == lone.cache_len == 6 and packed.row_owner.count(DEAD) == 1  # the sibling: unseen, not gone
    torch.testing.assert_close(mine.forward(torch.tensor([[11]])).logits[0], lone.forward(torch.tensor([[11]])).logits[0],
                               rtol=1e-4, atol=1e-4)
    [b_next] = packed.run([(1, torch.tensor(B[3:]))])
    torch.testing.assert_close(b_next[0], alone(make_lm, tiny_target, B)[-1], rtol=1e-4, atol=1e-4)
    packed.compact()
    assert DEAD not in packed.row_owner and packed.row_owner.count(0) == packed.live(0) == 7


def test_a_pass_that_raises_part_way_drops_what_it_wrote(tiny_target, make_lm):
    """A packed pass whose second layer raises (its first has written the pass's rows) leaves the cache as it was:
    every layer holds exactly the rows `row_owner` names, and the owners' next passes get what they get alone.
    Before, the first layer kept the failed pass's rows and every later pass read them."""
    packed = PackedCache(make_lm(tiny_target))
    packed.run([(0, torch.tensor(A[:4]))])
    packed.run([(1, torch.tensor(B[:3]))])

    def second_layer(module, args):
        raise RuntimeError("planted")

    hook = tiny_target.model.layers[1].register_forward_pre_hook(second_layer)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            packed.run([(0, torch.tensor(A[4:5])), (1, torch.tensor(B[3:4]))])
    finally:
        hook.remove()
    assert packed.lm.cache_len == len(packed.row_owner) == 7
    assert all(layer.get_seq_length() == 7 for layer in packed.lm._cache.layers)
    a_next, b_next = packed.run([(0, torch.tensor(A[4:5])), (1, torch.tensor(B[3:4]))])
    torch.testing.assert_close(a_next[0], alone(make_lm, tiny_target, A[:5])[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b_next[0], alone(make_lm, tiny_target, B[:4])[-1], rtol=1e-4, atol=1e-4)
