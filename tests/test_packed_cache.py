"""A packed cache (`models.packed_cache`): many owners' rows in one cache, each seeing only its own, so a batch's
draft models run a depth's tokens in one pass."""

from __future__ import annotations

import torch

from specdraft.models.packed_cache import PackedCache

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
