"""The `model` drafter: a separate, smaller LM with its own KV cache drafts token by token."""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import sample, warp


class ModelDrafter(Drafter):
    """Draft with a small LM of the target's vocabulary, warped exactly like the target.

    The draft cache holds the committed sequence it has seen plus the draft tokens it fed;
    after each verdict it is cut back to what the target kept.
    """

    name = "model"

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._fed_draft = 0  # draft tokens fed into the cache during the last proposal

    def begin(self, prompt: torch.Tensor) -> None:
        self.model.reset()
        self.model.prefill(prompt[:-1].unsqueeze(0))

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        model, params = self.model, ctx.params
        feed = ctx.sequence[model.cache_len:].unsqueeze(0)  # [1, 1 or 2] committed tokens not yet seen
        seen = ctx.seen
        tokens, dists = [], []
        for i in range(k):
            logits = model.forward(feed, logits_to_keep=1).logits[0]  # [1, V]
            if seen is not None and tokens:  # the draft token just fed is part of the next prefix
                seen = seen.index_fill(0, tokens[-1], True)
            if params.greedy and params.repetition_penalty == 1.0:
                token = logits.argmax(-1)  # [1]
            else:
                rows = seen.unsqueeze(0) if seen is not None else None
                probs = warp(logits, params, rows)  # [1, V]
                token = probs.argmax(-1) if params.greedy else sample(probs, ctx.generator)
                if not params.greedy:
                    dists.append(probs)
            tokens.append(token)
            if i < k - 1:
                feed = token.view(1, 1)
        self._fed_draft = max(k - 1, 0)
        draft_tokens = torch.cat(tokens) if tokens else ctx.sequence.new_empty(0)  # [k]
        q_draft = torch.cat(dists) if dists else None  # [k, V]
        return Draft.chain(draft_tokens, q_draft)

    def commit(self, prev_len: int, num_accepted: int) -> None:
        # The cache holds the sequence up to prev_len plus the fed draft tokens; keep the accepted ones.
        self.model.truncate(prev_len + min(num_accepted, self._fed_draft))
