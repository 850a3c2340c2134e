"""Checking greedy output against plain decoding, with the near-tie rule of docs/design.md.

Kernels for different batch shapes (one token vs k + 1 tokens a pass) round differently,
so in bf16 two greedy runs may part where the target's top two logits are nearly equal.
A divergence is accepted only there: `compare_greedy` scores the reference prefix up to the
first difference with the target and reports the gap between its top two logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdraft.models.causal_lm import CausalLM

# The largest top-two logit gap (in logits) that counts as a near-tie, per dtype: a few units
# in the last place of the logits' magnitude (~16-32 for these models).
NEAR_TIE_MARGIN = {torch.bfloat16: 0.5, torch.float16: 0.05, torch.float32: 1e-3}


@dataclass
class GreedyComparison:
    """How a greedy output compares with the reference (plain decoding)."""

    equal: bool
    diverged_at: int | None = None  # index into the generated tokens
    top2_gap: float | None = None  # the target's top-2 logit gap at the divergence
    near_tie: bool = False

    @property
    def acceptable(self) -> bool:
        """Equal, or parted only at a numerical near-tie."""
        return self.equal or self.near_tie


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first differing token, or, when one run is a strict prefix of the other, the length of the
    shorter (an output cut short is a mismatch); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


@torch.inference_mode()
def top2_gap(target: CausalLM, context: list[int]) -> float:
    """The gap between the target's two largest next-token logits after `context`."""
    target.reset()
    logits = target.forward(torch.tensor([context], device=target.device), logits_to_keep=1).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    target.reset()
    return float(top[0] - top[1])


def compare_greedy(
    target: CausalLM,
    prompt_ids: list[int],
    reference: list[int],
    candidate: list[int],
    margin: float | None = None,
) -> GreedyComparison:
    """Compare `candidate` with the greedy `reference`; at a divergence, measure the target's top-2 gap."""
    at = first_divergence(reference, candidate)
    if at is None:
        return GreedyComparison(equal=True)
    if at == min(len(reference), len(candidate)):  # one run ended where the other went on: no near-tie explains it
        return GreedyComparison(equal=False, diverged_at=at)
    margin = NEAR_TIE_MARGIN.get(target.dtype, 1e-3) if margin is None else margin
    gap = top2_gap(target, prompt_ids + reference[:at])
    return GreedyComparison(equal=False, diverged_at=at, top2_gap=gap, near_tie=gap <= margin)


@torch.inference_mode()
def exact_two_tokens(model, prompt: list[int]) -> np.ndarray:
    """`[V, V]` probability that a Hugging Face causal LM `model` samples (a, b) after `prompt` at temperature 1: the
    exact distribution the statistical checks compare the first two generated tokens with."""
    vocab = model.config.vocab_size
    first = model(torch.tensor([prompt], device=model.device)).logits[0, -1].double().softmax(-1)  # [V]
    rows = torch.tensor([prompt + [a] for a in range(vocab)], device=model.device)  # [V, L + 1]
    second = model(rows).logits[:, -1].double().softmax(-1)  # [V, V]
    return (first[:, None] * second).cpu().numpy()
