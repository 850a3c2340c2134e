"""The `model` drafter: a separate, smaller LM with its own KV cache drafts token by token."""

from __future__ import annotations

from typing import Generator

import torch

from specdraft.drafters.base import Draft, DraftContext, DraftPass, Drafter, run_passes
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.drafters.dynamic_tree import grow_dynamic_tree
from specdraft.sampling import sample, warp


# Stop drafting once the chain's estimated survival falls below this (measured: README).
DEFAULT_MIN_CONFIDENCE = 0.35
DEFAULT_CONTEXT = 16  # prompt tokens the first read takes at most (0 = all; measured: class doc)
DEFAULT_CATCH_UP = 16  # committed tokens a later catch-up reads at most (0 = all it missed, up to `context`)


class ModelDrafter(Drafter):
    """Draft with a small LM of the target's vocabulary, warped exactly like the target.

    The draft cache holds the committed sequence it has seen plus the draft tokens it fed;
    after each verdict it is cut back to what the target kept.

    `min_confidence` ends a proposal early: once the product of the draft's own
    probabilities for its tokens (its estimate that the whole chain survives) falls below
    it, drafting more would mostly be wasted. The stop depends only on what the draft has
    already drawn, so verification stays exact.

    `context` (> 0) caps how much of a long prompt the draft reads: only its last `context`
    tokens, at positions counted from there (rotary attention sees only relative positions).
    The draft's prefill is its largest cost on long prompts (RAG, summaries, extraction), where
    answers are often short; drafts stay proposals, so the output is unchanged. 0 reads it all. 16 by default,
    as many as a catch-up: in a batch a first read stalls every sequence (8 sequences a step on a 2-core Zen 5:
    0.99x plain batching against 0.96x with 64), and alone it drafted as well (AVX2 kernels, each prompt 3 times:
    1.09x `ar` against 1.08x; a 64-token first read took 0.14-0.16 s there, six target steps).
    `catch_up` (> 0) caps a later catch-up (the tokens committed while others drafted or steps ran plain): the
    draft keeps what it has read and reads only the last `catch_up` tokens it missed, right after it, as if the
    ones between had not been written (a splice: drafts stay proposals). A probe after a long plain stretch so
    costs a short read: on a 2-core AVX2 CPU a catch-up of 64 tokens took 0.14 s, three target steps, and a
    drafter that never paid was probed four times an answer. With `catch_up` 0, a catch-up of more than
    `context` tokens starts the draft over from the sequence's last `context` tokens instead of reading them
    all. Either way a catch-up never costs more than a first read (k=auto prices it so: `unread`).

    The draft stays within its own positions (`max_context`: what it holds of `--context`, which may be less than
    the target's): a read that would leave it too few for the draft to follow starts over from the sequence's last
    `context` tokens, at most half of those it has room for (0: half), and a draft is never longer than its
    positions. It so drafts on past its context instead of failing the run; drafts stay proposals.
    """

    name = "model"

    def __init__(self, model: CausalLM, min_confidence: float = DEFAULT_MIN_CONFIDENCE,
                 context: int = DEFAULT_CONTEXT, catch_up: int = DEFAULT_CATCH_UP) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise SpecdraftError(f"min draft confidence must be in [0, 1), got {min_confidence}.")
        if context < 0:
            raise SpecdraftError(f"--draft-context must be >= 0 (0 = the whole prompt), got {context}.")
        if catch_up < 0:
            raise SpecdraftError(f"--draft-catch-up must be >= 0 (0 = every token missed), got {catch_up}.")
        self.model = model
        self.min_confidence = min_confidence
        self.context, self.catch_up = context, catch_up
        self._skipped = 0  # prompt tokens before the draft's window: sequence position = draft position + this
        self._fed_draft = 0  # draft tokens fed into the cache during the last proposal
        self._tree_slots: list[int | None] | None = None  # per tree token: where the cache holds it (None: unfed)

    def begin(self, prompt: torch.Tensor) -> None:
        # No prefill here: the first proposal reads the prompt, so a request (or a policy) that
        # never drafts never pays for the draft's prefill.
        self.model.reset()
        self._skipped = 0

    @property
    def cache_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def model_parts(self) -> list[Drafter]:
        return [self]

    def _read(self) -> int:
        """How many tokens of the committed sequence the draft cache covers (read or skipped)."""
        return self._skipped + self.model.cache_len

    def _plan_read(self, length: int, ahead: int) -> tuple[int, bool]:
        """How a sequence of `length` tokens is caught up: (`_skipped` after it, so that sequence position = draft
        position + `_skipped` for the tokens read from then on; whether the draft starts over). A later catch-up of
        more than `catch_up` tokens reads the last `catch_up` of them after what the cache holds (a splice); a first
        read of more than `context` tokens (or, without `catch_up`, a later one) starts over from the last `context`;
        else all it missed, after the cache. A read that would leave fewer than `ahead` of the draft's positions
        (`_ahead`) starts over from the last `context` tokens, at most half of those it has room for (class doc)."""
        unread, cached = length - self._read(), self.model.cache_len
        limit = min(self.catch_up, self.context) if self.context else self.catch_up  # never more than a first read
        if cached and limit and unread > limit:
            skipped, restart = length - limit - cached, False
        elif self.context and unread > self.context:
            skipped, restart = length - self.context, cached > 0
        else:
            skipped, restart = self._skipped, False
        room = self.model.max_context - ahead  # sequence tokens the draft may hold with a draft after them (>= 1)
        if length - skipped > room:
            return length - max(1, min(self.context or room, room // 2)), cached > 0
        return skipped, restart

    def _ahead(self, ctx: DraftContext, k: int) -> int:
        """The draft's positions a proposal of `k` tokens (a tree: nodes) takes past the sequence, within the positions
        it has (a longer draft is cut to them): a chain feeds every token but its last, up to `ctx.max_depth` with
        forced tokens; a tree at most its nodes."""
        if ctx.tree_branch > 1:
            return min(k, self.model.max_context - 1)
        return min(max(k, ctx.max_depth or k), self.model.max_context) - 1

    def _unread_tokens(self, ctx: DraftContext, ahead: int) -> torch.Tensor:  # [1, T']: what the draft must read
        self._skipped, restart = self._plan_read(ctx.sequence.shape[0], ahead)
        if restart:  # a new window: what the cache holds lies before it
            self.model.reset()
        return ctx.sequence[self._read():].unsqueeze(0)

    def unread(self, ctx: DraftContext) -> int:
        length = ctx.sequence.shape[0]
        skipped, restart = self._plan_read(length, self._ahead(ctx, ctx.max_depth or 1))  # a tree: by its depth
        return length - skipped - (0 if restart else self.model.cache_len)

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        self._tree_slots = None
        if ctx.tree_branch > 1:
            return self._propose_tree(ctx, k)
        return run_passes(self.propose_steps(ctx, k))

    def propose_steps(self, ctx: DraftContext, k: int) -> Generator[DraftPass, torch.Tensor, Draft]:
        """A chain, one model pass a token (`Drafter.propose_steps`); trees are proposed at once."""
        if ctx.tree_branch > 1:
            return self.propose(ctx, k)
        self._tree_slots = None
        model, params = self.model, ctx.params
        ahead = self._ahead(ctx, k)
        feed = self._unread_tokens(ctx, ahead)  # [1, T] committed tokens not yet seen (the prompt at first)
        seen = ctx.seen
        tokens, dists = [], []  # each [n]: a drawn token, then the tokens a constraint forces after it
        chosen: list[int] = []  # the tokens so far, for a constraint's mask
        most = ahead + 1  # with forced tokens a chain may pass k, never the budget nor the draft's positions
        k = min(k, most)
        drafted = fed = 0
        chain_confidence = 1.0
        for i in range(k):
            # a first read (the prompt's window) as a prompt pass: cheaper, and drafts are only proposals
            logits = yield DraftPass(model, feed, prompt=model.cache_len == 0)  # [1, V]
            if i:
                fed += feed.shape[1]
            if ctx.grammar is not None:
                logits = ctx.constrain(logits, [chosen])
            if seen is not None and i:  # the draft tokens just fed are part of the next prefix
                seen = seen.index_fill(0, feed[0], True)
            if params.greedy and params.repetition_penalty == 1.0:
                token = logits.argmax(-1)  # [1]
                confidence = logits.float().softmax(-1).max() if self.min_confidence else None
            else:
                rows = seen.unsqueeze(0) if seen is not None else None
                probs = warp(logits, params, rows)  # [1, V]
                token = probs.argmax(-1) if params.greedy else sample(probs, ctx.generator)
                if not params.greedy:
                    dists.append(probs)
                # Greedy warps to a point mass: its confidence is the unwarped top probability.
                confidence = None if not self.min_confidence else (
                    logits.float().softmax(-1).max() if params.greedy else probs[0, token[0]])
            tokens.append(token)
            if ctx.grammar is not None:  # the tokens the grammar alone decides next: drafted without passes
                chosen.append(int(token))
                forced = ctx.grammar.forced_run(chosen, most - len(chosen))
                if forced:
                    chosen += forced
                    token = torch.cat([token, token.new_tensor(forced)])  # [1 + m]
                    tokens.append(token[1:])
                    if dists:  # point masses, drawn from one-hot rows (accepted for sure: p = 1 there)
                        dists.append(torch.zeros(len(forced), logits.shape[-1], device=logits.device).scatter_(
                            1, token[1:, None], 1.0))
            drafted += token.shape[0]
            if confidence is not None:
                chain_confidence *= float(confidence)
                if chain_confidence < self.min_confidence:
                    break
            if drafted >= most or (chosen and chosen[-1] in ctx.grammar.eos_ids):
                break
            if i < k - 1:
                feed = token.view(1, -1)
        self._fed_draft = fed
        draft_tokens = torch.cat(tokens) if tokens else ctx.sequence.new_empty(0)  # [k]
        q_draft = torch.cat(dists) if dists else None  # [k, V]
        return Draft.chain(draft_tokens, q_draft)

    def _propose_tree(self, ctx: DraftContext, budget: int) -> Draft:
        """A dynamic tree of up to `budget` tokens (see `dynamic_tree`), one draft pass per level."""
        model = self.model
        base = ctx.sequence.shape[0]
        budget = self._ahead(ctx, budget)
        feed = self._unread_tokens(ctx, budget)  # [1, T] committed tokens not yet seen
        first_read = model.cache_len == 0  # the prompt's window: a prompt pass, as in the chain
        root_logits = model.forward(feed, logits_to_keep=1, prompt=first_read).logits[0]  # [1, V] after the root

        def expand(frontier: list[int], block: torch.Tensor, depth: int, visible: torch.Tensor,
                   parents: list[int]) -> torch.Tensor:
            # Depth-d tokens sit at position base - 1 + d (the root, the last committed token, at base - 1).
            offsets = torch.full((len(frontier),), base - 1 + depth - self._read(), device=block.device)  # [m]
            return model.forward(block, len(frontier), offsets=offsets, visible=visible).logits[0]  # [m, V]

        grown = grow_dynamic_tree(root_logits, expand, ctx, budget, self.min_confidence)
        self._tree_slots = grown.fed_slots
        return grown.draft

    def commit(self, prev_len: int, path: list[int]) -> None:
        # The cache holds the sequence up to prev_len plus the fed draft tokens; keep the accepted ones.
        prev_len -= self._skipped  # in the draft cache's positions
        if self._tree_slots is None:
            self.model.truncate(prev_len + min(len(path), self._fed_draft))
            return
        fed = []  # the accepted path's tokens the draft has seen: a prefix of the path
        for node in path:
            if self._tree_slots[node] is None:
                break
            fed.append(self._tree_slots[node])
        self.model.keep(prev_len, fed)
