"""Continuous batching: many requests step together, one target pass over all their blocks per step.

```
add(request)        # queued to join: the next steps read its prompt a chunk at a time, then it steps
while active:
    step.take_step(active sequences)         # the step a single request runs, over the packed cache:
        plan      each sequence's k as alone, then the goodput rule for the batch (0 = plain)
        propose   each sequence drafts with its own drafter (draft-model passes shared by depth)
        score     target.forward(concat [last_i, d_i1 .. d_ik_i]): one pass; a mask keeps sequences apart
        verify    each sequence as alone, every verdict read in one host sync
        commit    keep the accepted rows (a tree: the accepted path) of each sequence
        emit      each sequence's event; finished sequences leave
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
policy first picks its source and k as if it ran alone (`step.choose_source`: probes included), then the
goodput rule sets the k of those it chose to draft for the batch as a whole, so a batch of one steps as a single
request does. At two sequences and more, a batch size where the steps that drafted have given fewer committed
tokens per second than plain steps steps plain for a while (`goodput.RealizedGoodput`: the costs the rule does
not model, such as a draft's reads stalling every sequence, show there); where the policies and the rule chose plain
for every sequence, the next few steps of that size step plain without asking (`RealizedGoodput.declined`:
planning is host work plain batching never does).

Draft models are batched too: the sequences drafting with the same weights share one packed draft cache
(`models.packed_cache`: each drafter's model becomes a view of it as its sequence joins), and the drafters' model
passes (`Drafter.propose_steps`) run in lockstep, a depth's tokens of every sequence in one pass
(`step.propose`); a draft model's tree (`tree_budget`) runs its level passes alone, over its view of the packed
cache (`PackedCache.run_tree`).

Trees: with a `tree_budget` each sequence's k counts nodes, as a single request's does; a tree's block sits at its
depths and each of its tokens sees its own ancestors (`TreeLayout.block_attention`), and the cache keeps its last
token's row and the accepted path's. A drafter that reads the target's features gets them as alone: the prompt's
from the chunks that read it, then each step the rows the pass kept, before its commit.

Constraints (`constraints`): a sequence's drafter masks its q and its target rows are masked as alone; before each
step, the tokens its grammar alone decides are appended without a pass (`_force`) and lead its next block, unscored.

Faults: what raises fails the sequences it concerns, and no other. A sequence's own work (its prompt's read and join,
its drafter's calls, a draft pass of its own, its verification, commit and event) fails that sequence alone
(`step.Faults`); a draft pass several sequences share fails them all, and its packed cache drops what it wrote. A
failed target pass fails every sequence of the step, and the cache goes back to its rows before the pass, however
far the pass got. A failed sequence leaves as a cancelled one does (its rows, its draft rows), emits nothing at that
step, and goes to `take_failed()` with its error; the cache's length is `len(row_owner)` after any fault, and the
other sequences, stepping, joining or waiting, go on as if it had never been there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdraft.constraints import Constraint
from specdraft.drafters.base import DraftContext, Drafter
from specdraft.engine import DEFAULT_TREE_BRANCH, Completion, check_tree_options
from specdraft.errors import SpecdraftError
from specdraft.goodput import RealizedGoodput, choose_batch_k
from specdraft.models.causal_lm import PREFILL_CHUNK, CausalLM
from specdraft.models.packed_cache import PackedCache
from specdraft.policy import MARGIN, MAX_AUTO_K, AutoK, FixedK, StepCosts
from specdraft.prefix_cache import PrefixCache
from specdraft.run import RunState, StepEvent, check_request, start_run
from specdraft.sampling import SamplingParams
from specdraft.stats import GenerationStats
from specdraft.step import Faults, Plan, Rules, Seq, Stepped, force, plan_alone, take_step

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


def _within(ks: list[int], free: list[bool], widest: int | None) -> list[int]:
    """`ks` with the largest of the `free` ones lowered a token at a time until the pass, Σ (k + 1), fits in `widest`
    tokens (None: as they are)."""
    ks = list(ks)
    while widest is not None and sum(k + 1 for k in ks) > widest:
        lowered = [i for i, k in enumerate(ks) if free[i] and k > 0]
        if not lowered:
            break
        ks[max(lowered, key=ks.__getitem__)] -= 1
    return ks


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
class _Joining:
    """A sequence whose prompt (but its last token) is being read, a chunk at a time, before it steps."""

    sequence: Seq
    read: int = 0  # prompt tokens read so far (or taken from the prefix cache)
    looked_up: bool = False  # whether the prefix cache was asked for its prompt's beginning
    cache_salt: str = ""  # its prefix-cache partition (`BatchRequest.cache_salt`)
    features: list[torch.Tensor] = field(default_factory=list)  # each [chunk, H]: for a drafter that reads them


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
        self.active: list[Seq] = []
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
        stops = check_request(target, ids, request.max_new_tokens, request.logprobs, request.stop)
        if request.k is not None and request.k < 1:
            raise SpecdraftError(f"k (draft tokens per step) must be >= 1 or None (auto), got {request.k}.")
        run = start_run(target, ids, request.sampling, request.max_new_tokens, stops, request.logprobs,
                        request.constraint)
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
        fixed = FixedK(request.k, self.tree_budget) if request.k is not None else None
        self.joining.append(_Joining(Seq(ident, run, drafter, self._policy.successor(), fixed, need),
                                     cache_salt=request.cache_salt))
        return ident

    def _pack_drafter(self, ident: int, drafter: Drafter) -> None:
        """Point the drafter's draft models at views of the batch's packed draft caches (one per set of weights), so
        the sequences drafting with the same weights run their draft tokens of a depth in one pass (module doc)."""
        for part in drafter.model_parts():
            lm = part.model
            if not isinstance(lm, CausalLM):
                continue
            packed = self._draft_caches.pop(id(lm.model), None)
            if packed is None:  # on the cache the device wants (a GPU's static one, with its captured passes)
                packed = PackedCache(CausalLM(lm.model, lm.tokenizer, name=lm.name, warm=False))
            self._draft_caches[id(lm.model)] = packed  # the last used last
            part.model = packed.view(ident)

    def _release_drafts(self, *idents: int) -> None:
        """These sequences are gone: their draft rows leave the packed caches, and a cache no sequence uses goes (a
        drafter whose weights are its own, e.g. an early-exit view made per sequence, leaves none behind), but the
        last used one whose passes replay captured CUDA graphs: the next request drafting with those weights would
        capture them all again (about a second of a GPU request's time). It holds its weights, so their id names no
        other module while it is kept."""
        for packed in self._draft_caches.values():
            for ident in idents:
                packed.release(ident)
            packed.compact()
        idle = [key for key, packed in self._draft_caches.items() if not packed.owners]
        kept = idle[-1] if idle and self._draft_caches[idle[-1]].lm.widest_graph is not None else None
        self._draft_caches = {key: packed for key, packed in self._draft_caches.items()
                              if packed.owners or key == kept}

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
                    if seq.reads_features:
                        seq.drafter.claim_features()  # the passes return the states its drafter reads
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

    def _leave(self, leaving: list[Seq], errors: dict[int, Exception | None] | None = None) -> None:
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
        """Each active sequence appends the tokens its grammar alone decides (`step.force`), to be read in its next
        block; a sequence they finish leaves. A sequence whose next token sits at position 0 waits for its first
        pass (`_stepping`)."""
        events, finished = [], []
        for seq in self.active:
            forced = force(seq, self.target) if seq.run.sequence.shape[0] > 1 else None
            if forced is not None:
                events.append((seq.ident, forced))
                if forced.finish_reason is not None:
                    finished.append(seq)
        self._leave(finished)
        return events

    def _stepping(self) -> list[Seq]:
        """The sequences this step advances: all, but at most one whose next token sits at position 0 (a one-token
        prompt), and that one first: a sequence's first token runs on the 16-bit kernels where every other pass runs
        on int8 activations (`kernels.prompt_pass`), and a pass keeps only its leading rows so. The others wait."""
        first = [seq for seq in self.active if seq.run.sequence.shape[0] == 1]
        return first[:1] + [seq for seq in self.active if seq.run.sequence.shape[0] > 1]

    @staticmethod
    def _plan(seq: Seq, ctx: DraftContext, limit: int, rules: Rules) -> Plan:
        """A sequence's plan as if it ran alone (`step.plan_alone`), which the goodput rule then caps (`_choose`)."""
        return plan_alone(seq, ctx, limit, rules)

    def _choose(self, stepping: list[Seq], plans: list[Plan]) -> list[int]:
        """Each sequence's k: the goodput rule over the sequences whose policy chose to draft (not a probe, not a
        fixed k), each at most the k it chose alone, the others' blocks priced in the pass as they are (module doc).
        The cap: the alone choice already weighed each token against the pass it widens, and beside other blocks
        a token costs no less where passes are bound by compute, while the estimate of a width not yet timed is
        optimistic (measured: a sequence whose policy chose 1 drafted 6 into a 9-token pass that cost 2.9x a
        3-token one). On a GPU the step's pass stays within the widest captured graph (`CausalLM.widest_graph`)."""
        ks, widest = [plan.k for plan in plans], self.target.widest_graph
        if self.costs.verify_estimate(1) is None:  # nothing timed yet: each policy's first draft, within the graph
            return _within(ks, [seq.fixed is None for seq in stepping], widest)
        joint = [i for i, (seq, plan) in enumerate(zip(stepping, plans))
                 if plan.k > 0 and seq.fixed is None and not seq.policy.estimates(plan.source).probing]
        if not joint:
            return ks
        extra = sum(ks) + len(ks) - sum(ks[i] + 1 for i in joint)  # the others' blocks in the pass
        curves, beside = [], []
        for i in joint:  # at most the k it chose alone: beside other blocks a draft token costs no less
            run, policy, plan = stepping[i].run, stepping[i].policy, plans[i]
            left = policy.expected_left(len(run.generated), run.max_new_tokens - len(run.generated))
            curves.append(policy.expected_token_curve(plan.k, plan.source))
            beside.append(policy.draft_cost_curve(plan.k, plan.source, plan.unread, left, curves[-1]))
        chosen = choose_batch_k(curves, beside, lambda width: self.costs.verify_estimate(width + extra), margin=MARGIN,
                                max_width=None if widest is None else widest - extra)
        for i, k in zip(joint, chosen):
            ks[i] = k
        return ks

    def step(self) -> list[tuple[int, StepEvent]]:
        """Read joining prompts (a chunk's worth), then one step of every active sequence (`step.take_step`): (id,
        event) each; a finished sequence's event has its finish_reason and the sequence has left. Sequences that
        failed, joining or stepping, have no event at the step they fail and are in `take_failed()` (module doc:
        faults)."""
        self.last_step = None  # set again below if a pass runs
        self._read_joining()
        forced = self._force()  # 0. tokens the grammar alone decides
        if not self.active:
            return forced
        target, stepping = self.target, self._stepping()
        self.largest_batch = max(self.largest_batch, len(stepping))
        t0, cached, faults = time.perf_counter(), target.cache_len, Faults()
        # where drafting has given less than plain steps at this batch size, the auto sequences step plain
        gated = len(stepping) > 1 and not self.realized.allows_drafting(len(stepping))
        rules = Rules(self.tree_budget, self.tree_branch, lockstep=True, costs=self.costs, gated=gated,
                      crowded=len(self.active) > 1, plan=self._plan, choose=self._choose)
        try:
            done = take_step(target, stepping, rules, faults, self.row_owner)  # 1.-6.
        except Exception as error:  # what serves them all failed (the pass, the cache's keep): every sequence fails
            target.truncate(cached)  # the cache as before the pass, however far it got
            del self.row_owner[cached:]
            faults.update((seq.ident, error) for seq in stepping if seq.ident not in faults)
            done = Stepped([])
        for packed in self._draft_caches.values():  # the rejected drafts' rows, in one pass a cache
            packed.compact()
        ending = {ident for ident, event in done.events if event.finish_reason is not None}
        self._leave([seq for seq in stepping if seq.ident in ending and seq.ident not in faults])
        self._remove(faults)
        events = [(ident, event) for ident, event in forced + done.events if ident not in faults]
        asked = not gated and len(stepping) > 1 and done.width and not done.drafted
        if asked and any(seq.drafter is not None and seq.fixed is None for seq in stepping if seq.ident not in faults):
            self.realized.declined(len(stepping))  # the auto sequences chose plain: the next steps do not ask
        if done.width:
            self.last_step = BatchStep(len(stepping), done.drafted, sum(len(event.token_ids) for _, event in events),
                                       time.perf_counter() - t0, done.width, done.pass_seconds if done.timed else None)
            if done.timed:
                self.realized.record(len(stepping), done.drafted > 0, self.last_step.committed, self.last_step.seconds)
        return events

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
