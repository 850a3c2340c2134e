"""The greedy comparison behind every exactness check: a strict prefix is a mismatch, and only a near-tie excuses a
differing token."""

from __future__ import annotations

import torch

from conftest import tiny_config, tiny_model
from specdraft.exactness import compare_greedy, first_divergence
from specdraft.models.causal_lm import CausalLM


def test_first_divergence_finds_the_first_differing_token_or_the_shorter_end():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([], []) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # cut short
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # ran on
    assert first_divergence([1, 2, 3], []) == 0


def test_an_output_cut_short_is_never_acceptable():
    target = CausalLM(tiny_model(tiny_config(), seed=0))
    prompt = [3, 4, 5]
    reference = [7, 8, 9, 10]
    for candidate, at in ((reference[:2], 2), (reference + [11], 4)):
        verdict = compare_greedy(target, prompt, reference, candidate, margin=1e9)  # any token gap would pass
        assert (verdict.equal, verdict.acceptable, verdict.diverged_at, verdict.top2_gap) == (False, False, at, None)


def test_a_differing_token_is_excused_only_at_a_near_tie():
    target = CausalLM(tiny_model(tiny_config(), seed=0))
    prompt, reference = [3, 4, 5], [7, 8, 9]
    with torch.inference_mode():
        gap = float(torch.topk(target.model(torch.tensor([prompt + [7]])).logits[0, -1], 2).values.diff().abs())
    near = compare_greedy(target, prompt, reference, [7, 1, 9], margin=gap + 1e-3)
    far = compare_greedy(target, prompt, reference, [7, 1, 9], margin=gap / 2)
    assert near.diverged_at == far.diverged_at == 1 and near.top2_gap is not None
    assert near.acceptable and not far.acceptable
