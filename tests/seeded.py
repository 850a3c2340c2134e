"""Seeded randomness the verification tests share."""

import torch


def gen(seed: int) -> torch.Generator:
    """A torch.Generator seeded with `seed`."""
    return torch.Generator().manual_seed(seed)


def transition_logits(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, draft) logits [vocab, vocab], row t the next-token logits after token t: the draft's are the
    target's plus noise of the same scale (related to the target, but clearly different)."""
    g = gen(seed)
    target = 1.5 * torch.randn(vocab, vocab, generator=g)
    draft = target + 1.5 * torch.randn(vocab, vocab, generator=g)
    return target, draft
