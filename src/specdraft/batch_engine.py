"""Continuous batching: many requests step together, one target pass over all their blocks per step.

```
add(request)        # joins between steps: its prompt is read into the packed cache, seeing only itself
while active:
    ks      = choose_batch_k(...)            # 1. each sequence's k for the batch's goodput (0 = plain)
    drafts  = [drafter_i.propose(ctx_i, k_i)] # 2. each sequence drafts with its own drafter
    logits  = target.forward(concat [last_i, d_i1 .. d_ik_i])  # 3. one pass; a mask keeps sequences apart
    verdict_i = verify(draft_i, rows_i)       # 4. per sequence, greedy or exact sampled, as alone
    keep the accepted rows of each sequence; finished sequences leave (their rows are dropped)
```

The target's KV cache is packed: the committed tokens of every active sequence but its last, in the order
they were written, each row tagged with its sequence (`row_owner`). A joining prompt is read alone, into a cache
of its own over the same weights, and its rows are appended (`CausalLM.append_cache`). A step appends every
sequence's block [last, d1 .. dk] at its own positions; each token sees its own sequence's rows and the earlier
tokens of its own block, nothing else (`_step_visibility`). Afterwards `CausalLM.keep` keeps, per sequence, the
row of its last token and of the accepted drafts; the bonus or recovered token is the new last. The CPU's
attention kernels skip hidden keys and see a sequence's own keys in the order it wrote them, and the matmul
kernels compute each token's row alone, so there a sequence's tokens are bit for bit those it gets alone;
elsewhere (PyTorch's attention) kernels may add in another order: greedy outputs then agree with single runs
except at numerical near-ties.

Each sequence has its own drafter (made by `make_drafter`, or its request's own factory: a draft model needs its
own cache, so the factory gives each a `CausalLM` of its own over the shared weights), sampling, generator,
budget, stop strings, log-probabilities and acceptance estimates (an `AutoK`'s); the pass cost by width is shared
(`pass_costs`). Chains only for now: trees, feature drafters and a batched draft model pass are the
single-request engine's (`engine.SpeculativeDecoder`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.engine import MAX_TOP_LOGPROBS, Completion, RunState, StepEvent, add_logprobs, sync_device
from specdraft.errors import SpecdraftError
from specdraft.goodput import choose_batch_k
from specdraft.models.causal_lm import CausalLM
from specdraft.policy import FIRST_K, MARGIN, MAX_AUTO_K, AutoK
from specdraft.sampling import SamplingParams, target_rows
from specdraft.stats import GenerationStats
from specdraft.text import IncrementalText
from specdraft.verify import verify

DEFAULT_MAX_BATCH = 8


DEFAULT_DRAFTER = "default"  # a request's drafter: the decoder's `make_drafter`


@dataclass
class BatchRequest:
    """One request for the batch: prompt token ids, sampling, budget, stop strings, and optionally its own
    drafter factory (None: plain decoding), a fixed k (None: the goodput rule chooses each step; a fixed k keeps a
    seeded sampled answer reproducible whatever else is in the batch) and log-probabilities (as `engine.stream`)."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    make_drafter: Callable[[], Drafter] | None | str = DEFAULT_DRAFTER
    k: int | None = None
    logprobs: int | None = None


@dataclass
class BatchStep:
    """What one step did: sequences in the pass, draft tokens in all, tokens committed, seconds."""

    sequences: int
    drafted: int
    committed: int
    seconds: float


@dataclass
class _Sequence:
    """An active sequence: its run state, drafter and acceptance estimates."""

    ident: int
    run: RunState
    drafter: Drafter | None
    policy: AutoK
    k: int | None  # fixed, or None: chosen by the goodput rule


class BatchedDecoder:
    """Generates many requests at once over `target` (module doc); `make_drafter()` gives each sequence its
    drafter (None: plain batched decoding). Not thread-safe: one caller steps it."""

    def __init__(self, target: CausalLM, make_drafter: Callable[[], Drafter] | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_k: int = MAX_AUTO_K) -> None:
        if max_batch < 1:
            raise SpecdraftError(f"The batch must hold at least one sequence, got max_batch={max_batch}.")
        self.target, self.make_drafter = target, make_drafter
        self.max_batch, self.max_k = max_batch, max_k
        self.pass_costs = AutoK(max_k=max_batch * (max_k + 1))  # only its pass timings by width are used
        self.active: list[_Sequence] = []
        self.row_owner: list[int] = []  # [cache_len]: the sequence each cache row belongs to
        self.last_step: BatchStep | None = None  # for the metrics
        self.largest_batch = 0
        self._next_ident = 0
        self._reader = CausalLM(target.model, target.tokenizer, name=target.name)  # reads joining prompts alone
        target.reset()

    # ----- joining and leaving ----------------------------------------------------------------------
    def add(self, request: BatchRequest) -> int:
        """Start `request` (its prompt is read into the cache now); returns its id for the events."""
        if len(self.active) >= self.max_batch:
            raise SpecdraftError(f"The batch is full ({self.max_batch} sequences); wait for one to finish.")
        target, ids = self.target, [int(t) for t in request.prompt_ids]
        if not ids or min(ids) < 0 or max(ids) >= target.vocab_size:
            raise SpecdraftError(f"A prompt needs at least one token, each in [0, {target.vocab_size}).")
        if request.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}.")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise SpecdraftError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.logprobs}.")
        if len(ids) >= target.max_context:
            raise SpecdraftError(f"The prompt has {len(ids)} tokens, but {target.name} holds {target.max_context}.")
        ident, self._next_ident = self._next_ident, self._next_ident + 1
        device = target.device
        sequence = torch.tensor(ids, dtype=torch.long, device=device)  # [L]
        seen = None
        if request.sampling.repetition_penalty != 1.0:
            seen = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)
            seen[sequence] = True
        stats = GenerationStats()
        stats.prompt_tokens = len(ids)
        started = time.perf_counter()
        cached, owners = target.cache_len, len(self.row_owner)
        try:
            self._prefill(ident, sequence[:-1])
            maker = self.make_drafter if request.make_drafter == DEFAULT_DRAFTER else request.make_drafter
            drafter = maker() if maker is not None else None
            if drafter is not None and drafter.needs_features:
                raise SpecdraftError(f"The {drafter.name!r} drafter reads the target's features, which the batched "
                                     "engine does not hand out yet; choose model, ngram or suffix.")
        except BaseException:  # the others' cache stays as it was
            target.truncate(cached)
            del self.row_owner[owners:]
            raise
        stats.prefill_seconds = time.perf_counter() - started
        if drafter is not None:
            drafter.begin(sequence)
        run = RunState(sequence, seen, request.sampling, request.sampling.make_generator(device),
                       request.max_new_tokens, IncrementalText(target.tokenizer, [s for s in request.stop if s]),
                       stats, started, request.logprobs)
        if request.k is not None and request.k < 1:
            raise SpecdraftError(f"k (draft tokens per step) must be >= 1 or None (auto), got {request.k}.")
        self.active.append(_Sequence(ident, run, drafter, AutoK(max_k=self.max_k), request.k))
        return ident

    def _prefill(self, ident: int, tokens: torch.Tensor) -> None:  # tokens: [L - 1]
        """Read a joining prompt (but its last token) as it is read alone, into a cache of its own over the same
        weights, and append those rows to the packed cache: the same states, bit for bit."""
        if tokens.shape[0] == 0:
            return
        self._reader.reset()
        self._reader.prefill(tokens.unsqueeze(0))
        self.target.append_cache(self._reader)
        self._reader.reset()
        self.row_owner += [ident] * tokens.shape[0]

    def cancel(self, ident: int) -> None:
        """Stop sequence `ident` now (its rows leave the cache); unknown ids are ignored."""
        self._leave([seq for seq in self.active if seq.ident == ident])

    def _leave(self, leaving: list[_Sequence]) -> None:
        """These sequences leave: their drafters end, and their rows go in one pass over the cache."""
        if not leaving:
            return
        for seq in leaving:
            self.active.remove(seq)
            if seq.drafter is not None:
                seq.drafter.end(seq.run.sequence)
        gone = {seq.ident for seq in leaving}
        kept = [row for row, owner in enumerate(self.row_owner) if owner not in gone]
        self.target.keep(0, kept)
        self.row_owner = [self.row_owner[row] for row in kept]

    # ----- one step -----------------------------------------------------------------------------------
    def _limit(self, seq: _Sequence) -> int:
        """The most draft tokens this sequence may take: its budget, the context, max_k."""
        run = seq.run
        room = self.target.max_context - run.sequence.shape[0] - 1
        return max(0, min(run.max_new_tokens - len(run.generated) - 1, room, seq.k or self.max_k))

    def _context(self, seq: _Sequence, limit: int) -> DraftContext:
        run = seq.run
        return DraftContext(run.sequence, run.params, run.generator, run.seen, tree_branch=1, max_depth=limit)

    def _stepping(self) -> list[_Sequence]:
        """The sequences this step advances: all, but at most one whose next token sits at position 0 (a one-token
        prompt), and that one first: a sequence's first token runs on the 16-bit kernels where every other pass runs
        on int8 activations (`kernels.prompt_pass`), and a pass keeps only its leading rows so. The others wait."""
        first = [seq for seq in self.active if seq.run.sequence.shape[0] == 1]
        return first[:1] + [seq for seq in self.active if seq.run.sequence.shape[0] > 1]

    def _choose(self, stepping: list[_Sequence], sources: list[str | None], limits: list[int]) -> list[int]:
        """Each sequence's k: the goodput rule over measured pass costs (FIRST_K before any is measured)."""
        fixed = [limit if source and seq.k is not None else 0 for seq, source, limit in zip(stepping, sources, limits)]
        chosen = [seq.k is None and source is not None for seq, source in zip(stepping, sources)]
        if self.pass_costs.verify_estimate(1) is None:
            return [min(FIRST_K, limit) if auto else k for auto, limit, k in zip(chosen, limits, fixed)]
        curves, costs = [], []
        for seq, source, limit, auto in zip(stepping, sources, limits, chosen):
            if not auto:  # plain, or a fixed k: priced as a width already in the pass
                curves.append([1.0])
                costs.append(0.0)
                continue
            curves.append(seq.policy.expected_token_curve(limit, source))
            costs.append(seq.policy.draft_seconds(source, plain=self.pass_costs.verify_estimate(1)))
        extra = sum(fixed)
        ks = choose_batch_k(curves, costs, lambda width: self.pass_costs.verify_estimate(width + extra), margin=MARGIN)
        return [k if auto else f for k, f, auto in zip(ks, fixed, chosen)]

    def _step_visibility(self, owners: list[int], blocks: list[int]) -> torch.Tensor:
        """[T, N + T] bool: block token j (of sequence owners[j]) sees its sequence's cache rows and the earlier
        tokens of its own block."""
        device = self.target.device
        rows = torch.tensor(self.row_owner, dtype=torch.long, device=device)  # [N]
        mine = torch.tensor(owners, dtype=torch.long, device=device)  # [T]
        block = torch.tensor(blocks, dtype=torch.long, device=device)  # [T]: which sequence block (0..B-1)
        index = torch.arange(len(owners), device=device)  # [T]
        in_block = (block[:, None] == block[None, :]) & (index[None, :] <= index[:, None])  # [T, T]
        return torch.cat([mine[:, None] == rows[None, :], in_block], dim=1)

    def step(self) -> list[tuple[int, StepEvent]]:
        """One step of every active sequence: (id, event) each; a finished sequence's event has its
        finish_reason and the sequence has left."""
        if not self.active:
            return []
        target = self.target
        stepping = self._stepping()
        self.largest_batch = max(self.largest_batch, len(stepping))
        t0 = time.perf_counter()
        limits = [self._limit(seq) for seq in stepping]
        contexts = [self._context(seq, limit) for seq, limit in zip(stepping, limits)]
        sources = [seq.drafter.source(ctx) if seq.drafter is not None and limit > 0 else None
                   for seq, ctx, limit in zip(stepping, contexts, limits)]
        ks = self._choose(stepping, sources, limits)
        drafts, draft_seconds, unread = [], [], []
        for seq, ctx, source, k in zip(stepping, contexts, sources, ks):  # 2. each sequence drafts alone
            began = time.perf_counter()
            unread.append(seq.drafter.unread(ctx) if k > 0 else 0)
            draft = seq.drafter.propose(ctx, k) if k > 0 else Draft.chain(ctx.sequence.new_empty(0))
            drafts.append(draft)
            draft_seconds.append(time.perf_counter() - began)
        # 3. one target pass over [last, d1 .. dk] of every sequence, each at its own positions
        blocks = [torch.cat([seq.run.sequence[-1:], draft.tokens]) for seq, draft in zip(stepping, drafts)]
        owners = [seq.ident for seq, block in zip(stepping, blocks) for _ in range(block.shape[0])]
        which = [i for i, block in enumerate(blocks) for _ in range(block.shape[0])]
        positions = torch.cat([seq.run.sequence.shape[0] - 1 + torch.arange(block.shape[0], device=block.device)
                               for seq, block in zip(stepping, blocks)])  # [T]
        tokens = torch.cat(blocks)  # [T]
        cached = target.cache_len
        sync_device(target.device)
        t1 = time.perf_counter()
        logits = target.forward(tokens.unsqueeze(0), tokens.shape[0], offsets=positions - cached,
                                visible=self._step_visibility(owners, which)).logits[0]  # [T, V]
        events, kept_rows, start = [], [], 0
        verdicts, rows_of = [], []
        for seq, draft, block in zip(stepping, drafts, blocks):  # 4. verify each sequence as alone
            width = block.shape[0]
            run = seq.run
            rows_of.append(logits[start : start + width])  # [k + 1, V]
            p_target = target_rows(rows_of[-1], run.params, run.seen, block)  # [k + 1, V]
            verdict = verify(draft, p_target, None if run.params.greedy else run.generator)
            num_accepted, next_token = torch.cat([verdict.num_accepted[:1], verdict.next_token[:1]]).tolist()
            verdicts.append((num_accepted, next_token))
            kept_rows += list(range(start, start + 1 + num_accepted))  # in the block: its last and accepted rows
            start += width
        pass_seconds = time.perf_counter() - t1
        self.pass_costs.observe(tokens.shape[0] - 1, 0, 0.0, pass_seconds, source=None)
        target.keep(cached, kept_rows)  # the cache keeps each sequence's last and accepted rows
        self.row_owner += [seq.ident for seq, (a, _) in zip(stepping, verdicts) for _ in range(1 + a)]
        finished = []
        for seq, draft, source, (num_accepted, next_token), k, seconds, read, rows in zip(
                stepping, drafts, sources, verdicts, ks, draft_seconds, unread, rows_of):
            run = seq.run
            prev_len = run.sequence.shape[0]
            path = list(range(num_accepted))
            if k > 0:
                seq.drafter.commit(prev_len, path)
                seq.policy.observe(k, num_accepted, seconds, pass_seconds, source, path, read, draft.scores)
            elif seq.drafter is not None:
                seq.policy.observe(0, 0, 0.0, pass_seconds, source)
            event = run.emit(k, draft.tokens[:num_accepted].tolist(), next_token, num_accepted == k,
                             target.eos_token_ids, target.max_context)
            run.stats.record_step(k, event.accepted, source if k > 0 else None, path, k, seconds,
                                  pass_seconds + (t1 - t0) / len(stepping))
            run.stats.new_tokens, run.stats.wall_seconds = len(run.generated), time.perf_counter() - run.started
            if run.logprobs is not None:  # the rows that decided the emitted tokens: a chain's first ones
                add_logprobs(event, rows[: len(event.token_ids)], run.logprobs)
            events.append((seq.ident, event))
            if event.finish_reason is not None:
                finished.append(seq)
        self._leave(finished)
        self.last_step = BatchStep(len(stepping), sum(ks), sum(len(event.token_ids) for _, event in events),
                                   time.perf_counter() - t0)
        return events

    def stats(self, ident: int) -> GenerationStats | None:
        """The statistics of active sequence `ident` (None once it has left)."""
        return next((seq.run.stats for seq in self.active if seq.ident == ident), None)

    def generate_all(self, requests: Sequence[BatchRequest]) -> list[Completion]:
        """Run `requests` to the end, at most max_batch at a time (the next joins as one leaves), in order."""
        pending = list(enumerate(requests))
        results: dict[int, Completion] = {}
        running: dict[int, tuple[int, RunState, list[int], list[str], list[str]]] = {}  # by sequence id
        while pending or self.active:
            while pending and len(self.active) < self.max_batch:
                index, request = pending.pop(0)
                ident = self.add(request)
                running[ident] = (index, self.active[-1].run, [], [], [])
            for ident, event in self.step():
                index, run, token_ids, kinds, pieces = running[ident]
                token_ids += event.token_ids
                kinds += event.kinds
                pieces.append(event.text)
                if event.finish_reason is not None:
                    results[index] = Completion(run.sequence[: run.stats.prompt_tokens].tolist(), token_ids,
                                                "".join(pieces), event.finish_reason, run.stats, kinds)
                    del running[ident]
        return [results[i] for i in range(len(requests))]
