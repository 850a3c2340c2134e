"""Continuous batching: many requests step together, one target pass over all their blocks per step.

```
add(request)        # queued to join: the next steps read its prompt a chunk at a time, then it steps
while active:
    ks      = choose_batch_k(...)            # 1. each sequence's k for the batch's goodput (0 = plain)
    drafts  = [drafter_i.propose(ctx_i, k_i)] # 2. each sequence drafts with its own drafter
    logits  = target.forward(concat [last_i, d_i1 .. d_ik_i])  # 3. one pass; a mask keeps sequences apart
    verdict_i = verify(draft_i, rows_i)       # 4. per sequence, greedy or exact sampled, as alone
                                              #    (greedy chains together: the rows' argmax in one host read)
    keep the accepted rows (a tree: the accepted path) of each sequence; finished sequences leave
```

The target's KV cache is packed: the committed tokens of every active sequence but its last, in the order
they were written, each row tagged with its sequence (`row_owner`). A joining prompt is read alone, into a cache
of its own over the same weights, at most `PREFILL_CHUNK` tokens between two steps (the chunks a single request's
prefill reads), and its rows are appended once it is read (`CausalLM.append_cache`). Where that is exact
(`CausalLM.reads_split_exactly`) the read starts after the longest beginning the prompt shares with a prompt read
before, whose rows a `prefix_cache.PrefixCache` kept (a shared system prompt, a conversation's earlier turns). A step appends every
sequence's block [last, d1 .. dk] at its own positions; each token sees its own sequence's rows and the earlier
tokens of its own block, nothing else (`packed_cache.packed_visibility`). Afterwards `CausalLM.keep` keeps, per
sequence, the row of its last token and of the accepted drafts; the bonus or recovered token is the new last. The CPU's
attention kernels skip hidden keys and see a sequence's own keys in the order it wrote them, and the matmul
kernels compute each token's row alone, so there a sequence's tokens are bit for bit those it gets alone;
elsewhere (PyTorch's attention) kernels may add in another order: greedy outputs then agree with single runs
except at numerical near-ties.

Memory: a sequence reserves, as it joins, the cache its whole budget can fill (prompt + max_new_tokens rows of the
target's KV cache, and of its draft model's where it has one: `kv_need`); with a `kv_budget` a request that does
not fit now waits (`NoRoom`), one that could never fit is refused, and no step can run the caches past the budget.
The reservation is freed when the sequence leaves. A step's own rows stay within it (a block never runs past a
sequence's budget), but the packed buffers grow in copies (`kv_cache.GrowingLayer`), so the process briefly holds
an old buffer beside its larger successor.

Each sequence has its own drafter (made by `make_drafter`, or its request's own factory: a draft model needs its
own cache, so the factory gives each a `CausalLM` of its own over the shared weights), sampling, generator,
budget, stop strings, log-probabilities and acceptance estimates (an `AutoK`'s, carried over from the last
sequence to leave as a single request's policy carries them from the last request); what passes and drafts cost
belongs to the machine and is shared (`costs`: passes timed by their total width). Each step a sequence's own
policy first picks its source and k as if it ran alone (`engine.choose_source`: probes included), then the
goodput rule sets the k of those it chose to draft for the batch as a whole, so a batch of one steps as a single
request does. At two sequences and more, a batch size where the steps that drafted have given fewer committed
tokens per second than plain steps steps plain for a while (`goodput.RealizedGoodput`: the costs the rule does
not model, such as a draft's reads stalling every sequence, show there).

Draft models are batched too: the sequences drafting with the same weights share one packed draft cache
(`models.packed_cache`: each drafter's model becomes a view of it as its sequence joins), and the drafters' model
passes (`Drafter.propose_steps`) run in lockstep, a depth's tokens of every sequence in one pass
(`_propose_all`); a draft model's tree (`tree_budget`) runs its level passes alone, over its view of the packed
cache (`PackedCache.run_tree`).

Trees: with a `tree_budget` each sequence's k counts nodes, as a single request's does; a tree's block sits at its
depths and each of its tokens sees its own ancestors (`TreeLayout.block_attention`), and the cache keeps its last
token's row and the accepted path's. A drafter that reads the target's features gets them as alone: the prompt's
from the chunks that read it, then each step the rows the pass kept, before its commit.

Constraints (`constraints`): a sequence's drafter masks its q and its target rows are masked as alone; before each
step, the tokens its grammar alone decides are appended without a pass (`_force`) and lead its next block, unscored.

Faults: what raises fails the sequences it concerns, and no other. A sequence's own work (its prompt's read and join,
its drafter's calls, a draft pass of its own, its verification, commit and event) fails that sequence alone
(`_own_work`); a draft pass several sequences share fails them all, and its packed cache drops what it wrote. A
failed target pass fails every sequence of the step, and the cache goes back to its rows before the pass, however
far the pass got. A failed sequence leaves as a cancelled one does (its rows, its draft rows), emits nothing at that
step, and goes to `take_failed()` with its error; the cache's length is `len(row_owner)` after any fault, and the
other sequences, stepping, joining or waiting, go on as if it had never been there.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from specdraft.constraints import Constraint, start_grammar
from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.engine import (DEFAULT_TREE_BRANCH, MAX_TOP_LOGPROBS, Completion, RunState, StepEvent, add_logprobs,
                              check_tree_options, choose_source, sync_device)
from specdraft.errors import SpecdraftError
from specdraft.goodput import RealizedGoodput, choose_batch_k
from specdraft.models.causal_lm import PREFILL_CHUNK, CausalLM
from specdraft.models.graph_decoder import graphs_captured
from specdraft.models.packed_cache import CacheView, PackedCache, packed_visibility
from specdraft.policy import MARGIN, MAX_AUTO_K, AutoK, StepCosts
from specdraft.prefix_cache import PrefixCache
from specdraft.sampling import SamplingParams, target_rows
from specdraft.stats import GenerationStats
from specdraft.text import IncrementalText
from specdraft.verify import verify

DEFAULT_MAX_BATCH = 8
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20  # rows of prompts read before (`prefix_cache`): 9,300 tokens of the 1.5B target
KV_SHARE_OF_FREE = 0.5  # the default KV budget: this share of the memory free once the models are loaded


class NoRoom(SpecdraftError):
    """The batch has no room for a request now (sequences or KV budget); it fits once others leave."""


class OverBudget(SpecdraftError):
    """A request whose cache alone would exceed the KV budget: it can never join."""


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations on `device`: a GPU's free memory, or the host's available memory (Linux's
    MemAvailable); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_kv_budget(device: torch.device) -> int | None:
    """The KV budget when none is given: KV_SHARE_OF_FREE of the memory free now (None: unknown, unbounded)."""
    free = free_memory_bytes(device)
    return None if free is None else int(free * KV_SHARE_OF_FREE)


def megabytes(size: int) -> str:
    """`size` bytes as MiB for messages."""
    return f"{size / (1 << 20):,.0f} MiB"


DEFAULT_DRAFTER = "default"  # a request's drafter: the decoder's `make_drafter`


@dataclass
class BatchRequest:
    """One request for the batch: prompt token ids, sampling, budget, stop strings, and optionally its own
    drafter factory (None: plain decoding), a fixed k (None: the goodput rule chooses each step; a fixed k keeps a
    seeded sampled answer reproducible whatever else is in the batch), log-probabilities and a cache salt (as
    `engine.stream`)."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    make_drafter: Callable[[], Drafter] | None | str = DEFAULT_DRAFTER
    k: int | None = None
    logprobs: int | None = None
    constraint: Constraint | None = None  # what the answer must match (`constraints`)
    cache_salt: str = ""  # the prompt shares prefix-cache rows only with prompts of the same salt


@dataclass
class BatchStep:
    """What one step did: sequences in the pass, draft tokens in all, tokens committed, seconds; the target pass's
    width (tokens) and seconds (None where the step captured a CUDA graph: not a pass's usual cost)."""

    sequences: int
    drafted: int
    committed: int
    seconds: float
    width: int = 0
    pass_seconds: float | None = None


@dataclass
class _Sequence:
    """An active sequence: its run state, drafter and acceptance estimates."""

    ident: int
    run: RunState
    drafter: Drafter | None
    policy: AutoK
    k: int | None  # fixed, or None: chosen by the goodput rule
    kv_bytes: int = 0  # the cache memory reserved for it (`BatchedDecoder.kv_need`)
    unscored: int = 1  # tokens at its end no pass has read: the last committed one, and forced ones after it

    @property
    def reads_features(self) -> bool:
        """Whether its drafter reads the target's final hidden states (`Drafter.features`)."""
        return self.drafter is not None and self.drafter.needs_features


@dataclass
class _Joining:
    """A sequence whose prompt (but its last token) is being read, a chunk at a time, before it steps."""

    sequence: _Sequence
    read: int = 0  # prompt tokens read so far (or taken from the prefix cache)
    looked_up: bool = False  # whether the prefix cache was asked for its prompt's beginning
    cache_salt: str = ""  # its prefix-cache partition (`BatchRequest.cache_salt`)
    features: list[torch.Tensor] = field(default_factory=list)  # each [chunk, H]: for a drafter that reads them


@contextmanager
def _own_work(seq: _Sequence, faults: dict[int, Exception]) -> Iterator[None]:
    """Work that is `seq`'s alone (its drafter's calls, its verification, its event): an exception fails `seq` only,
    its first going to `faults` under its id, and the batch goes on without it (module doc: faults)."""
    try:
        yield
    except Exception as error:
        faults.setdefault(seq.ident, error)


@dataclass
class _Verified:
    """What a step's pass decided for one sequence, before it commits (`BatchedDecoder._verify_pass`)."""

    seq: _Sequence
    draft: Draft
    plan: tuple[str | None, int, int]  # (source, k, unread) as its policy planned it
    seconds: float  # its drafting's
    num_accepted: int
    next_token: int  # the recovered or bonus token
    bonus: bool
    path: list[int]  # the accepted draft nodes, root to leaf
    accepted: list[int]  # their tokens
    rows: torch.Tensor  # [k + 1, V]: the pass's logits after its last token, then after its draft's
    kept: list[int]  # the rows of its block the cache keeps: its unscored ones (its last, forced ones), the path's


class BatchedDecoder:
    """Generates many requests at once over `target` (module doc); `make_drafter()` gives each sequence its
    drafter (None: plain batched decoding); `kv_budget`: the bytes the sequences' caches may reserve together
    (None: unbounded). Not thread-safe: one caller steps it."""

    def __init__(self, target: CausalLM, make_drafter: Callable[[], Drafter] | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_k: int = MAX_AUTO_K, kv_budget: int | None = None,
                 tree_budget: int = 0, tree_branch: int = DEFAULT_TREE_BRANCH,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        check_tree_options(tree_budget, tree_branch)
        if max_batch < 1:
            raise SpecdraftError(f"The batch must hold at least one sequence, got max_batch={max_batch}.")
        if kv_budget is not None and kv_budget <= 0:
            raise SpecdraftError(f"The KV budget must be positive, got {kv_budget} bytes.")
        if prefix_cache_bytes < 0:
            raise SpecdraftError(f"The prefix cache's size must be >= 0 (0: none), got {prefix_cache_bytes} bytes.")
        self.target, self.make_drafter = target, make_drafter
        self.max_batch, self.max_k, self.kv_budget = max_batch, max_k, kv_budget
        self.tree_budget, self.tree_branch = tree_budget, tree_branch
        nodes = tree_budget or max_k  # the most draft tokens one sequence puts in a pass
        self.costs = StepCosts(max_batch * (nodes + 1) + 1)  # passes by total width; each source's draft and read
        self.realized = RealizedGoodput()  # what drafting has actually given at each batch size
        # the last to leave: a joining sequence carries it over
        self._policy = AutoK(max_k=nodes, tree=bool(tree_budget), costs=self.costs)
        self.active: list[_Sequence] = []
        self.joining: list[_Joining] = []  # their prompts are read first come, first served, between steps
        self.failed: list[tuple[int, Exception]] = []  # sequences that failed, with why: the caller takes them
        self.row_owner: list[int] = []  # [cache_len]: the sequence each cache row belongs to
        self.last_step: BatchStep | None = None  # for the metrics
        self.largest_batch = 0
        self._next_ident = 0
        # reads joining prompts alone, on the kind of cache the target's is (growing, or a GPU's static one)
        self._reader = CausalLM(target.model, target.tokenizer, name=target.name, static_cache=target.static,
                                warm=False)
        self._draft_caches: dict[int, PackedCache] = {}  # by draft weights (id of the module): sequences' draft rows
        # prompts read before, where their rows give the bits of reading them again (`prefix_cache`)
        self.prefixes = (PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and target.reads_split_exactly
                         else None)
        target.reset()

    # ----- joining and leaving ----------------------------------------------------------------------
    def add(self, request: BatchRequest) -> int:
        """Queue `request` to join (its prompt is read by the next steps, `_read_joining`); returns its id for the
        events. A request refused here leaves everything as it was: `NoRoom` when it must wait for others to leave
        (max_batch, or the KV budget), SpecdraftError when it is wrong or could never fit."""
        if self.size >= self.max_batch:
            raise NoRoom(f"The batch is full ({self.max_batch} sequences); wait for one to finish.")
        target, ids = self.target, [int(t) for t in request.prompt_ids]
        if not ids or min(ids) < 0 or max(ids) >= target.vocab_size:
            raise SpecdraftError(f"A prompt needs at least one token, each in [0, {target.vocab_size}).")
        if request.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}.")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise SpecdraftError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.logprobs}.")
        if len(ids) >= target.max_context:
            raise SpecdraftError(f"The prompt has {len(ids)} tokens, but {target.name} holds {target.max_context}.")
        if request.k is not None and request.k < 1:
            raise SpecdraftError(f"k (draft tokens per step) must be >= 1 or None (auto), got {request.k}.")
        grammar = start_grammar(request.constraint, target)
        maker = self.make_drafter if request.make_drafter == DEFAULT_DRAFTER else request.make_drafter
        drafter = maker() if maker is not None else None
        need = self.kv_need(len(ids), request.max_new_tokens, drafter)
        if self.kv_budget is not None and need > self.kv_budget:
            raise OverBudget(f"The prompt ({len(ids)} tokens) and max_tokens ({request.max_new_tokens}) need "
                             f"{megabytes(need)} of KV cache, more than the server's budget of "
                             f"{megabytes(self.kv_budget)}; ask for fewer tokens or shorten the prompt.")
        if self.kv_budget is not None and self.kv_reserved + need > self.kv_budget:
            raise NoRoom(f"The KV budget ({megabytes(self.kv_budget)}) is taken by the running sequences; "
                         "wait for one to finish.")
        ident, self._next_ident = self._next_ident, self._next_ident + 1
        if drafter is not None:
            self._pack_drafter(ident, drafter)
        if not self.size and target.cache_len != len(self.row_owner):  # someone else ran the target meanwhile
            target.reset()
        device = target.device
        sequence = torch.tensor(ids, dtype=torch.long, device=device)  # [L]
        seen = None
        if request.sampling.repetition_penalty != 1.0:
            seen = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)
            seen[sequence] = True
        stats = GenerationStats()
        stats.prompt_tokens = len(ids)
        run = RunState(sequence, seen, request.sampling, request.sampling.make_generator(device),
                       request.max_new_tokens, IncrementalText(target.tokenizer, [s for s in request.stop if s]),
                       stats, time.perf_counter(), request.logprobs, grammar)
        self.joining.append(_Joining(_Sequence(ident, run, drafter, self._policy.successor(), request.k, need),
                                     cache_salt=request.cache_salt))
        return ident

    def _pack_drafter(self, ident: int, drafter: Drafter) -> None:
        """Point the drafter's draft models at views of the batch's packed draft caches (one per set of weights), so
        the sequences drafting with the same weights run their draft tokens of a depth in one pass (module doc)."""
        for part in drafter.model_parts():
            lm = part.model
            if not isinstance(lm, CausalLM):
                continue
            packed = self._draft_caches.get(id(lm.model))
            if packed is None:  # on the cache the device wants (a GPU's static one, with its captured passes)
                packed = PackedCache(CausalLM(lm.model, lm.tokenizer, name=lm.name, warm=False))
                self._draft_caches[id(lm.model)] = packed
            part.model = packed.view(ident)

    def _release_drafts(self, *idents: int) -> None:
        """These sequences are gone: their draft rows leave the packed caches, and a cache no sequence uses goes (a
        drafter whose weights are its own, e.g. an early-exit view made per sequence, leaves none behind)."""
        for packed in self._draft_caches.values():
            for ident in idents:
                packed.release(ident)
            packed.compact()
        self._draft_caches = {key: packed for key, packed in self._draft_caches.items() if packed.owners}

    def kv_need(self, prompt_tokens: int, max_new_tokens: int, drafter: Drafter | None = None) -> int:
        """Bytes of cache a sequence may fill: prompt + max_new_tokens rows of the target's KV cache and of its
        drafter's own (a step's block never runs past them: see the module doc)."""
        per_token = self.target.kv_bytes_per_token + (drafter.cache_bytes_per_token if drafter is not None else 0)
        return (prompt_tokens + max_new_tokens) * per_token

    @property
    def kv_reserved(self) -> int:
        """Bytes of cache the sequences in the batch (stepping or joining) have reserved."""
        active, joining = list(self.active), list(self.joining)  # copies: the metrics read it from another thread
        return sum(seq.kv_bytes for seq in active) + sum(waiting.sequence.kv_bytes for waiting in joining)

    @property
    def size(self) -> int:
        """Sequences in the batch: stepping, or reading their prompt to join."""
        return len(self.active) + len(self.joining)

    def _read_joining(self) -> None:
        """Read joining prompts (but their last token), first come first served, a chunk of `PREFILL_CHUNK` tokens
        at a time at the offsets a single request's prefill reads them, until PREFILL_CHUNK tokens were read this
        step: into a cache of their own over the same weights (`_reader`), whose rows join the packed cache once the
        whole prompt is read. So a sequence holds the very states it holds alone, bit for bit, and a long prompt
        stalls the running answers a chunk's time at a step. A prompt that fails to read or join leaves (`failed`),
        its rows with it, and the next one is read."""
        budget = PREFILL_CHUNK
        while self.joining and budget > 0:
            joining = self.joining[0]
            seq = joining.sequence
            prompt = seq.run.sequence[:-1]  # [L - 1]
            try:
                started = time.perf_counter()
                if not joining.looked_up:
                    self._take_prefix(joining, prompt)
                if joining.read < prompt.shape[0]:
                    chunk = prompt[joining.read : joining.read + PREFILL_CHUNK]
                    self._read_chunk(joining, chunk)
                    joining.read += chunk.shape[0]
                    budget -= chunk.shape[0]
                seq.run.stats.prefill_seconds += time.perf_counter() - started
                if joining.read == prompt.shape[0]:
                    self._join(joining, prompt.shape[0])
            except Exception as error:  # this request fails; the packed cache and the others go on as they were
                self._remove({seq.ident: error})

    def _take_prefix(self, joining: _Joining, prompt: torch.Tensor) -> None:  # prompt: [L - 1]
        """Start reading a joining prompt after the longest beginning it shares with a prompt read before: its rows
        come from the prefix cache (not for a drafter that reads the target's features: they are not kept)."""
        joining.looked_up = True
        seq = joining.sequence
        if self.prefixes is None or seq.reads_features:
            return
        joining.read = seq.run.stats.cached_prompt_tokens = self.prefixes.resume(self._reader, prompt,
                                                                                    joining.cache_salt)

    def clear_prefixes(self) -> None:
        """Forget the prompts kept for their prefixes (a benchmark's cold start)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    def _read_chunk(self, joining: _Joining, chunk: torch.Tensor) -> None:  # chunk: [n]
        features = joining.sequence.reads_features
        states = self._reader.prefill(chunk.unsqueeze(0), hidden=features)  # [n, H] or None
        if features:
            joining.features.append(states)

    def _join(self, joining: _Joining, rows: int) -> None:
        """The read prompt's `rows` join the packed cache and the sequence steps from now on (a drafter that reads
        the target's features gets the prompt's, but its last token's, as alone: `Drafter.features`). The rows are
        the sequence's as soon as they are in: should what follows raise, they leave with it (`_read_joining`)."""
        seq, target, cached = joining.sequence, self.target, self.target.cache_len
        try:
            if rows:
                target.append_cache(self._reader)
        except BaseException:
            target.truncate(cached)
            raise
        self.row_owner += [seq.ident] * rows  # the cache's length and its owners agree from here on
        if self.prefixes is not None:
            self.prefixes.keep(self._reader, seq.run.sequence[:rows], joining.cache_salt)
        self._reader.reset()
        if seq.drafter is not None:
            seq.drafter.begin(seq.run.sequence)
            if seq.reads_features:
                hidden = target.config.hidden_size
                seq.drafter.features(torch.cat(joining.features) if joining.features else
                                     torch.zeros(0, hidden, dtype=target.dtype, device=target.device))
        self.joining.pop(0)  # it is the first: prompts are read in order
        self.active.append(seq)

    def take_failed(self) -> list[tuple[int, Exception]]:
        """The sequences that failed since the last call, joining or stepping, with why (each is out of the batch,
        its rows and draft rows gone: module doc, faults)."""
        failed, self.failed = self.failed, []
        return failed

    def cancel(self, ident: int) -> None:
        """Stop sequence `ident` now (its rows leave the cache, or its prompt stops being read); unknown ids are
        ignored."""
        self._remove({ident: None})

    def _remove(self, errors: dict[int, Exception | None]) -> None:
        """The sequences of `errors` (id -> why it failed; None: cancelled) leave now, joining or stepping: a joining
        one's prompt stops being read, and each leaves as `_leave` has it (a failed join's rows too); unknown ids
        are ignored."""
        joining = [entry for entry in self.joining if entry.sequence.ident in errors]
        if joining and joining[0] is self.joining[0]:
            self._reader.reset()  # its prompt was being read
        self.joining = [entry for entry in self.joining if entry.sequence.ident not in errors]
        leaving = [entry.sequence for entry in joining] + [seq for seq in self.active if seq.ident in errors]
        self._leave(leaving, errors)

    def _leave(self, leaving: list[_Sequence], errors: dict[int, Exception | None] | None = None) -> None:
        """These sequences leave (out of `joining` already, or stepping): a stepping one's drafter ends, and their
        rows and draft rows go, in one pass over each cache. Those with an error in `errors` failed: they go to
        `failed` with it, as does one whose drafter's `end` raises (it has left all the same)."""
        if not leaving:
            return
        errors = dict(errors or {})
        gone = {seq.ident for seq in leaving}
        for seq in self.active:
            if seq.ident in gone and seq.drafter is not None:
                self._policy = seq.policy
                try:
                    seq.drafter.end(seq.run.sequence)
                except Exception as error:  # a broken drafter's end: the sequence leaves all the same
                    errors[seq.ident] = errors.get(seq.ident) or error
        self.active = [seq for seq in self.active if seq.ident not in gone]
        self._release_drafts(*gone)
        kept = [row for row, owner in enumerate(self.row_owner) if owner not in gone]
        self.target.keep(0, kept)
        self.row_owner = [self.row_owner[row] for row in kept]
        self.failed += [(seq.ident, errors[seq.ident]) for seq in leaving if errors.get(seq.ident) is not None]

    # ----- one step -----------------------------------------------------------------------------------
    def _force(self) -> list[tuple[int, StepEvent]]:
        """Each active sequence under a constraint (without logprobs) appends the tokens its grammar alone decides
        (`RunState.force`), to be read in its next block; a sequence they finish leaves. A sequence whose next token
        sits at position 0 waits for its first pass (`_stepping`)."""
        events, finished = [], []
        for seq in self.active:
            run = seq.run
            if run.grammar is None or run.logprobs is not None or run.sequence.shape[0] == 1:
                continue
            forced = run.force(self.target.eos_token_ids, self.target.max_context)
            if forced is None:
                continue
            seq.unscored += len(forced.token_ids)
            events.append((seq.ident, forced))
            if forced.finish_reason is not None:
                finished.append(seq)
        self._leave(finished)
        return events

    def _context(self, seq: _Sequence) -> tuple[DraftContext, int]:
        """What the sequence's drafter may read this step, and the most draft tokens it may take (a tree: nodes):
        within its budget, the context and max_k or the tree budget; a tree at most its fixed k or the policy's
        depth deep."""
        run = seq.run
        room = max(0, self.target.max_context - run.sequence.shape[0] - 1)  # draft tokens the context holds
        depth = min(run.max_new_tokens - len(run.generated) - 1, room)  # the deepest a draft may go and be emitted
        if not self.tree_budget:
            limit = max(0, min(depth, seq.k or self.max_k))
            return DraftContext(run.sequence, run.params, run.generator, run.seen, max_depth=limit,
                                grammar=run.grammar), limit
        limit = min(self.tree_budget, room) if depth > 0 else 0
        return DraftContext(run.sequence, run.params, run.generator, run.seen, tree_branch=self.tree_branch,
                            max_depth=min(depth, seq.k or seq.policy.max_depth), grammar=run.grammar), limit

    def _stepping(self) -> list[_Sequence]:
        """The sequences this step advances: all, but at most one whose next token sits at position 0 (a one-token
        prompt), and that one first: a sequence's first token runs on the 16-bit kernels where every other pass runs
        on int8 activations (`kernels.prompt_pass`), and a pass keeps only its leading rows so. The others wait."""
        first = [seq for seq in self.active if seq.run.sequence.shape[0] == 1]
        return first[:1] + [seq for seq in self.active if seq.run.sequence.shape[0] > 1]

    def _plan(self, seq: _Sequence, ctx: DraftContext, limit: int, gated: bool = False) -> tuple[str | None, int, int]:
        """(source, k, unread) for this sequence as if it ran alone: its policy's choice (a fixed k: the drafter's
        first source, all of k); (None, 0, 0) = plain, as for every auto sequence while `gated` (drafting has given
        less than plain steps at this batch size: `goodput.RealizedGoodput`; its policy is not asked)."""
        if seq.drafter is None or limit <= 0 or (gated and seq.k is None):
            return None, 0, 0
        if seq.k is not None:
            source = seq.drafter.source(ctx)
            return (source, limit, seq.drafter.unread(ctx)) if source is not None else (None, 0, 0)
        run = seq.run
        source, k, unread = choose_source(seq.drafter, seq.policy, ctx, limit, run.max_new_tokens - len(run.generated),
                                          len(run.generated))
        if k > 0 and unread > 0 and len(self.active) > 1 and seq.policy.estimates(source).probing:
            # A probe that must first catch up stalls the whole batch, where drafting pays least: it waits until
            # the sequence runs alone (measured: batches of 4 at 0.95x plain batching with such probes).
            seq.policy.estimates(source).probing = False
            return None, 0, 0
        return source, k, unread

    def _choose(self, stepping: list[_Sequence], plans: list[tuple[str | None, int, int]]) -> list[int]:
        """Each sequence's k: the goodput rule over the sequences whose policy chose to draft (not a probe, not a
        fixed k), each at most the k it chose alone, the others' blocks priced in the pass as they are (module doc).
        The cap: the alone choice already weighed each token against the pass it widens, and beside other blocks
        a token costs no less where passes are bound by compute, while the estimate of a width not yet timed is
        optimistic (measured: a sequence whose policy chose 1 drafted 6 into a 9-token pass that cost 2.9x a
        3-token one)."""
        ks = [k for _, k, _ in plans]
        if self.costs.verify_estimate(1) is None:  # nothing timed yet: each policy's first draft
            return ks
        joint = [i for i, (seq, (source, k, _)) in enumerate(zip(stepping, plans))
                 if k > 0 and seq.k is None and not seq.policy.estimates(source).probing]
        if not joint:
            return ks
        extra = sum(ks) + len(ks) - sum(ks[i] + 1 for i in joint)  # the others' blocks in the pass
        curves, beside = [], []
        for i in joint:  # at most the k it chose alone: beside other blocks a draft token costs no less
            seq, (source, top, unread) = stepping[i], plans[i]
            run, policy = seq.run, seq.policy
            left = policy.expected_left(len(run.generated), run.max_new_tokens - len(run.generated))
            curves.append(policy.expected_token_curve(top, source))
            beside.append(policy.draft_cost_curve(top, source, unread, left, curves[-1]))
        chosen = choose_batch_k(curves, beside, lambda width: self.costs.verify_estimate(width + extra), margin=MARGIN)
        for i, k in zip(joint, chosen):
            ks[i] = k
        return ks

    def _propose_all(self, stepping: list[_Sequence], contexts: list[DraftContext], ks: list[int],
                     faults: dict[int, Exception]) -> tuple[list[Draft | None], list[float]]:
        """Every sequence's draft of its k tokens (k = 0: none), and the seconds each took. The drafters' model passes
        (`Drafter.propose_steps`) run in lockstep: the passes asked of one packed draft cache at a step go through it
        together (`PackedCache.run`), the longest feed first so the fewest logits are computed, and each shares the
        pass's time by its tokens; a first read (which must lead its pass: `kernels.prompt_pass`) runs alone. A
        sequence whose drafter, or a pass of its own, raises has no draft (None) and goes to `faults`; a shared pass
        that raises sends all its sequences there (its packed cache drops what it wrote)."""
        drafts: list[Draft | None] = [None] * len(stepping)
        seconds = [0.0] * len(stepping)
        steps, asked = {}, {}

        def advance(i: int, logits: torch.Tensor | None) -> None:  # send the logits on; the draft if it is done
            began = time.perf_counter()
            asked.pop(i, None)
            with _own_work(stepping[i], faults):
                try:
                    asked[i] = next(steps[i]) if logits is None else steps[i].send(logits)
                except StopIteration as done:
                    drafts[i] = done.value
            seconds[i] += time.perf_counter() - began

        for i, (seq, ctx, k) in enumerate(zip(stepping, contexts, ks)):
            if k > 0:
                with _own_work(seq, faults):
                    steps[i] = seq.drafter.propose_steps(ctx, k)
                if i in steps:
                    advance(i, None)
            else:
                drafts[i] = Draft.chain(ctx.sequence.new_empty(0))
        while asked:
            together: dict[int, list[int]] = {}
            answers: dict[int, torch.Tensor] = {}
            for i, request in asked.items():
                if isinstance(request.model, CacheView) and not request.prompt:
                    together.setdefault(id(request.model.packed), []).append(i)
                    continue
                began = time.perf_counter()
                with _own_work(stepping[i], faults):
                    answers[i] = request.model.forward(request.tokens, logits_to_keep=1,
                                                       prompt=request.prompt).logits[0]  # [1, V]
                seconds[i] += time.perf_counter() - began
            for members in together.values():
                members.sort(key=lambda i: -asked[i].tokens.shape[1])
                packed = asked[members[0]].model.packed
                began = time.perf_counter()
                try:
                    rows = packed.run([(asked[i].model.owner, asked[i].tokens[0]) for i in members])  # each [1, V]
                except Exception as error:  # a pass of several sequences' drafts: each of them fails
                    for i in members:
                        faults.setdefault(stepping[i].ident, error)
                    continue
                spent, fed = time.perf_counter() - began, sum(asked[i].tokens.shape[1] for i in members)
                for i, logits in zip(members, rows):
                    answers[i] = logits
                    seconds[i] += spent * asked[i].tokens.shape[1] / fed
            for i in [i for i in asked if stepping[i].ident in faults]:
                del asked[i]
            for i, logits in answers.items():
                advance(i, logits)
        return drafts, seconds

    @staticmethod
    def _trimmed(seq: _Sequence, draft: Draft, source: str | None) -> Draft:
        """The prefix of a scored draft (a tree, a `suffix` chain) worth verifying, by the sequence's own policy as
        a single request trims it (a fixed k verifies all); under a constraint, without the point masses its grammar
        forbids (as alone)."""
        if draft.scores is not None and seq.k is None and draft.k:
            draft = draft.prefix(seq.policy.trim(draft.scores, source, draft.must_keep))
        return draft if seq.run.grammar is None else draft.allowed_by(seq.run.grammar)

    def step(self) -> list[tuple[int, StepEvent]]:
        """Read joining prompts (a chunk's worth), then one step of every active sequence: (id, event) each; a
        finished sequence's event has its finish_reason and the sequence has left. Sequences that failed, joining or
        stepping, have no event at the step they fail and are in `take_failed()` (module doc: faults)."""
        self.last_step = None  # set again below if a pass runs
        self._read_joining()
        forced = self._force()  # 1. tokens the grammar alone decides
        if not self.active:
            return forced
        target = self.target
        stepping = self._stepping()
        self.largest_batch = max(self.largest_batch, len(stepping))
        t0, captures = time.perf_counter(), graphs_captured()
        faults: dict[int, Exception] = {}  # the sequences whose own work failed this step: the first error of each
        cached = target.cache_len
        try:
            verified, width, t1, pass_seconds = self._verify_pass(stepping, faults)  # 2.-4.
        except Exception as error:  # the pass failed, and with it every sequence of the step
            target.truncate(cached)  # the cache as before the pass, however far it got
            del self.row_owner[cached:]
            for seq in stepping:
                faults.setdefault(seq.ident, error)
            verified, width, t1, pass_seconds = [], 0, t0, 0.0
        # a step that captured a CUDA graph paid once what no step pays again
        timed = width > 0 and graphs_captured() == captures
        if timed:
            self.costs.time_pass(width, pass_seconds)
        events, finished, eos_token_ids = [], [], target.eos_token_ids
        for v in verified:  # 5. each sequence commits its verdict and emits it, as alone
            seq, run, k, (source, _, read) = v.seq, v.seq.run, v.draft.k, v.plan
            with _own_work(seq, faults):
                prev_len = run.sequence.shape[0]
                if k > 0:
                    seq.drafter.commit(prev_len, v.path)
                if seq.drafter is not None:  # the pass was timed above, by its total width
                    seq.policy.observe(k, v.num_accepted, v.seconds, None, source if k > 0 else None, v.path, read,
                                       v.draft.scores, timed=timed)
                event = run.emit(k, v.accepted, v.next_token, v.bonus, eos_token_ids, target.max_context)
                run.stats.record_step(k, event.accepted, source if k > 0 else None, v.path,
                                      v.draft.layout.height if v.draft.layout is not None else k, v.seconds,
                                      pass_seconds + (t1 - t0) / len(stepping))
                run.stats.new_tokens, run.stats.wall_seconds = len(run.generated), time.perf_counter() - run.started
                if run.logprobs is not None:  # the rows that decided the emitted tokens: the root's, then the path's
                    decided = [row - seq.unscored + 1 for row in v.kept[seq.unscored - 1 :]]  # in `v.rows`
                    add_logprobs(event, v.rows[decided[: len(event.token_ids)]], run.logprobs)
                seq.unscored = 1  # the pass read everything but the token it emitted last
                events.append((seq.ident, event))
                if event.finish_reason is not None:
                    finished.append(seq)
        for packed in self._draft_caches.values():  # the rejected drafts' rows, in one pass a cache
            packed.compact()
        self._leave(finished)
        self._remove(faults)
        events = [(ident, event) for ident, event in forced + events if ident not in faults]
        if width:
            self.last_step = BatchStep(len(stepping), sum(v.draft.k for v in verified),
                                       sum(len(event.token_ids) for _, event in events), time.perf_counter() - t0,
                                       width, pass_seconds if timed else None)
        if timed:
            self.realized.record(len(stepping), self.last_step.drafted > 0, self.last_step.committed,
                                 self.last_step.seconds)
        return events

    def _verify_pass(self, stepping: list[_Sequence],
                     faults: dict[int, Exception]) -> tuple[list[_Verified], int, float, float]:
        """Steps 2 to 4 for the sequences stepping: each drafts, one target pass scores every block, each is verified
        as alone, and the cache keeps each one's last row and accepted path. A sequence whose own work raises goes
        to `faults` and drops out (the cache keeps none of its rows of the pass); what serves them all (the pass,
        the cache's keep) raises. Returns the verdicts, the pass's width (0: no pass ran, every sequence failed
        first), when it began and its seconds (its verification's included)."""
        target = self.target
        # where drafting has given less than plain steps at this batch size, the auto sequences step plain
        gated = len(stepping) > 1 and not self.realized.allows_drafting(len(stepping))
        contexts, limits = zip(*(self._context(seq) for seq in stepping))
        plans: list[tuple[str | None, int, int]] = [(None, 0, 0)] * len(stepping)
        for i, (seq, ctx, limit) in enumerate(zip(stepping, contexts, limits)):
            if not (seq.unscored > 1 and seq.reads_features):  # features of forced tokens come from a pass
                with _own_work(seq, faults):
                    plans[i] = self._plan(seq, ctx, limit, gated)
        ks = self._choose(stepping, plans)
        drafts, draft_seconds = self._propose_all(stepping, contexts, ks, faults)  # 2. draft passes shared by depth
        for i, (seq, draft, (source, _, _)) in enumerate(zip(stepping, drafts, plans)):
            if draft is not None:
                with _own_work(seq, faults):
                    drafts[i] = self._trimmed(seq, draft, source)
        well = [i for i, seq in enumerate(stepping) if seq.ident not in faults]  # those still in the step
        stepping, plans, drafts, draft_seconds = ([column[i] for i in well]
                                                  for column in (stepping, plans, drafts, draft_seconds))
        if not stepping:
            return [], 0, time.perf_counter(), 0.0
        # 3. one target pass over [last, d1 .. dk] of every sequence (forced tokens after its last), each at its own
        # positions (a tree: by depth)
        blocks = [torch.cat([seq.run.sequence[-seq.unscored:], draft.tokens]) for seq, draft in zip(stepping, drafts)]
        owners = [seq.ident for seq, block in zip(stepping, blocks) for _ in range(block.shape[0])]
        which = [i for i, block in enumerate(blocks) for _ in range(block.shape[0])]
        trees = [draft.layout.block_attention(seq.unscored) if draft.layout is not None else None
                 for seq, draft in zip(stepping, drafts)]
        positions = torch.cat([seq.run.sequence.shape[0] - seq.unscored + (
            tree[0] if tree is not None else torch.arange(block.shape[0], device=block.device))
            for seq, block, tree in zip(stepping, blocks, trees)])  # [T]
        tokens = torch.cat(blocks)  # [T]
        cached, device = target.cache_len, target.device
        sync_device(device)
        t1 = time.perf_counter()
        visible = packed_visibility(self.row_owner, owners, which, device)  # [T, cached + T]
        start = 0
        for block, tree in zip(blocks, trees):  # a tree's tokens see the root and their own ancestors in its block
            if tree is not None:
                visible[start : start + block.shape[0], cached + start : cached + start + block.shape[0]] = tree[1]
            start += block.shape[0]
        features = any(seq.reads_features for seq in stepping)
        # how far the furthest token reaches: a sequence's length plus its draft's depth (its last token, and any
        # forced ones, are already counted in its length)
        reach = max(seq.run.sequence.shape[0] + (draft.layout.height if draft.layout is not None else draft.k)
                    for seq, draft in zip(stepping, drafts))
        scored = target.forward(tokens.unsqueeze(0), tokens.shape[0], hidden_to_keep=tokens.shape[0] if features else 0,
                                offsets=positions - cached, visible=visible, reach=reach)
        logits = scored.logits[0]  # [T, V]
        # Greedy chains (no penalty, no constraint) are verified together: the argmax of every row and every fed token
        # come to the host in one read, the step's one sync for them (on a GPU each sequence's own read cost a round
        # trip); the others are verified one by one, each as alone (`verify`).
        together = [seq.run.params.greedy and seq.run.seen is None and seq.run.grammar is None and draft.layout is None
                    for seq, draft in zip(stepping, drafts)]
        to_host = torch.cat([logits.argmax(-1), tokens]) if any(together) else tokens
        host = to_host.tolist()
        choice, fed = host[: -tokens.shape[0]], host[-tokens.shape[0] :]  # [T] argmax per row (if read), [T] tokens
        verified, kept_rows, start = [], [], 0
        for seq, draft, block, plain, plan, seconds in zip(stepping, drafts, blocks, together, plans, draft_seconds):
            width, tree, run, unscored = block.shape[0], draft.layout, seq.run, seq.unscored
            with _own_work(seq, faults):  # 4. verify each sequence as alone
                rows = logits[start + unscored - 1 : start + width]  # [k + 1, V]: after its last, then the draft
                if plain:  # the longest draft prefix equal to the rows' argmax, then the argmax (`verify_greedy`)
                    targets = choice[start + unscored - 1 : start + width]
                    drafted = fed[start + unscored : start + width]
                    num_accepted = next((i for i, (d, t) in enumerate(zip(drafted, targets)) if d != t), len(drafted))
                    next_token, deepest = targets[num_accepted], num_accepted - 1
                else:
                    p_target = target_rows(run.masked(rows, draft), run.params, run.seen, block[unscored - 1 :],
                                           None if tree is None else tree.rows_ancestors())  # [k + 1, V]
                    verdict = verify(draft, p_target, None if run.params.greedy else run.generator)
                    num_accepted, next_token, deepest = torch.cat([verdict.num_accepted[:1], verdict.next_token[:1],
                                                                   verdict.deepest()[:1]]).tolist()
                path = tree.path(deepest) if tree is not None else list(range(num_accepted))
                bonus = tree.is_leaf(deepest) if tree is not None else num_accepted == draft.k
                # in the block: its unscored rows (its last, and forced ones) and the path's
                kept = list(range(unscored)) + [unscored + node for node in path]
                in_pass = [start + row for row in kept]
                if seq.reads_features:  # the kept rows' states, before commit
                    seq.drafter.features(scored.hidden_states[0][in_pass])
                kept_rows += in_pass
                verified.append(_Verified(seq, draft, plan, seconds, num_accepted, next_token, bonus, path,
                                          [fed[start + unscored + node] for node in path], rows, kept))
            start += width
        pass_seconds = time.perf_counter() - t1
        target.keep(cached, kept_rows)  # the cache keeps each sequence's last and accepted rows
        self.row_owner += [v.seq.ident for v in verified for _ in v.kept]
        return verified, tokens.shape[0], t1, pass_seconds

    def stats(self, ident: int) -> GenerationStats | None:
        """The statistics of sequence `ident`, stepping or joining (None once it has left)."""
        sequences = self.active + [joining.sequence for joining in self.joining]
        return next((seq.run.stats for seq in sequences if seq.ident == ident), None)

    def generate_all(self, requests: Sequence[BatchRequest]) -> list[Completion]:
        """Run `requests` to the end, as many at a time as max_batch and the KV budget let (the next joins as one
        leaves), in order; a request that fails to join raises its error."""
        pending = list(enumerate(requests))
        results: dict[int, Completion] = {}
        running: dict[int, tuple[int, RunState, list[int], list[str], list[str]]] = {}  # by sequence id
        while pending or self.size:
            while pending:
                try:
                    ident = self.add(pending[0][1])
                except NoRoom:
                    break
                index, _ = pending.pop(0)
                running[ident] = (index, self.joining[-1].sequence.run, [], [], [])
            events = self.step()
            for _, error in self.take_failed():
                raise error
            for ident, event in events:
                index, run, token_ids, kinds, pieces = running[ident]
                token_ids += event.token_ids
                kinds += event.kinds
                pieces.append(event.text)
                if event.finish_reason is not None:
                    results[index] = Completion(run.sequence[: run.stats.prompt_tokens].tolist(), token_ids,
                                                "".join(pieces), event.finish_reason, run.stats, kinds)
                    del running[ident]
        return [results[i] for i in range(len(requests))]
