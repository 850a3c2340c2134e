"""What every drafter returns and the interface the engine calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.sampling import SamplingParams


@dataclass
class Draft:
    """The proposal of one step.

    A chain is a tree whose parents are `i - 1` (the first token's parent, -1, is the last
    committed token). `q_draft` is the distribution each token was actually drawn from, or
    `None` for a deterministic proposal (verified as a point mass).
    """

    tokens: torch.Tensor  # [k] int64
    parents: torch.Tensor  # [k] int64
    q_draft: torch.Tensor | None = None  # [k, V] float32
    info: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def chain(tokens: torch.Tensor, q_draft: torch.Tensor | None = None) -> "Draft":
        """A chain draft: token i's parent is token i - 1."""
        parents = torch.arange(-1, tokens.shape[0] - 1, device=tokens.device)
        return Draft(tokens=tokens, parents=parents, q_draft=q_draft)


@dataclass
class DraftContext:
    """What a drafter may read when it proposes: the committed sequence and how to sample."""

    sequence: torch.Tensor  # [L] int64: prompt + committed tokens
    params: SamplingParams
    generator: torch.Generator
    seen: torch.Tensor | None  # [V] bool, tokens of `sequence` (only with a repetition penalty)


class Drafter:
    """Proposes tokens for the target to verify.

    Call order per request: `begin(prompt)`; then per step `source(ctx)`, and when that is
    not None, `propose(ctx, k)` and `commit(prev_len, num_accepted)`; finally `end(sequence)`.
    A drafter keeps whatever state it needs (a KV cache, an index) in step with the committed
    sequence (`ctx.sequence` only ever grows by committed tokens).
    """

    name: str = "base"

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L]
        """Start a new request with this prompt."""

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        """Who will propose this step (a name the policy keeps separate estimates for), or None
        when there is nothing worth proposing (the step is then plain decoding). `declined`
        names sources the policy has already turned down this step; the next `propose` comes
        from the source returned last."""
        return None if self.name in declined else self.name

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        """Up to `k` tokens continuing `ctx.sequence`."""
        raise NotImplementedError

    def commit(self, prev_len: int, num_accepted: int) -> None:
        """The sequence of length `prev_len` grew by `num_accepted` draft tokens and one more."""

    def end(self, sequence: torch.Tensor) -> None:  # sequence: [L] prompt + every committed token
        """The request is over (finished, or stopped early by its consumer)."""
