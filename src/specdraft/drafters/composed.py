"""Composition: a free drafter when it has something to propose, another drafter otherwise.

`ngram+model` drafts by prompt lookup whenever the tail of the sequence occurred before, and
with the draft model everywhere else. Each step's source is the name of the drafter that
proposed, so the policy keeps separate acceptance and cost estimates for each and the stats
record which one drafted. The fallback's KV cache simply lags while the first drafter
proposes; its next proposal reads the committed tokens it missed.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter


class ComposedDrafter(Drafter):
    """Ask `first`; when it has nothing to propose, `fallback` drafts."""

    def __init__(self, first: Drafter, fallback: Drafter) -> None:
        self.first, self.fallback = first, fallback
        self.name = f"{first.name}+{fallback.name}"
        self.needs_features = first.needs_features or fallback.needs_features
        self._chosen: Drafter | None = None  # who answered the last `source`
        self._proposer: Drafter | None = None  # who proposed the draft now being verified

    @property
    def cache_bytes_per_token(self) -> int:
        return self.first.cache_bytes_per_token + self.fallback.cache_bytes_per_token

    def model_parts(self) -> list[Drafter]:
        return self.first.model_parts() + self.fallback.model_parts()

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L]
        self.first.begin(prompt)
        self.fallback.begin(prompt)

    def claim_features(self) -> None:
        self.first.claim_features()
        self.fallback.claim_features()

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        for drafter in (self.first, self.fallback):
            name = drafter.source(ctx, declined)
            if name is not None:
                self._chosen = drafter
                return name
        self._chosen = None
        return None

    def unread(self, ctx: DraftContext) -> int:
        return (self._chosen or self.fallback).unread(ctx)

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        if self._chosen is None:  # called without `source`: ask now
            self.source(ctx)
        self._proposer = self._chosen or self.fallback
        return self._proposer.propose(ctx, k)

    def propose_steps(self, ctx: DraftContext, k: int):
        if self._chosen is None:
            self.source(ctx)
        self._proposer = self._chosen or self.fallback
        return self._proposer.propose_steps(ctx, k)

    def features(self, hidden: torch.Tensor) -> None:  # hidden: [n, H]
        for drafter in (self.first, self.fallback):
            if drafter.needs_features:
                drafter.features(hidden)

    def commit(self, prev_len: int, path: list[int]) -> None:
        if self._proposer is not None:
            self._proposer.commit(prev_len, path)
        self._chosen = self._proposer = None

    def end(self, sequence: torch.Tensor) -> None:  # sequence: [L]
        self.first.end(sequence)
        self.fallback.end(sequence)
