"""One step over a batch of sequences; a single request is the batch of one.

```
plan     each sequence's source and k, as if it ran alone       (policy, `choose_source`; a batch's rule after)
propose  each sequence drafts (a batch's draft-model passes in lockstep, one pass a depth)
score    one target pass over every block [unscored .., d1 .. dk], each at its own positions
verify   every verdict read in one host sync (greedy chains checked together)
commit   the cache keeps each sequence's unscored rows and accepted path; the drafters learn what was kept
emit     each sequence's event, cut at EOS, a stop string or the budget; its policy and statistics learn
```

`take_step` runs them in that order for `engine.SpeculativeDecoder` (one sequence, the target's cache its own) and
`batch_engine.BatchedDecoder` (many, one packed cache, `row_owner` naming each row's sequence). What a sequence does
alone (its drafter's calls, its verification, commit and event) fails it alone (`Faults`); a single request's
faults simply raise.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.models.causal_lm import CausalLM
from specdraft.models.graph_decoder import graphs_captured
from specdraft.models.packed_cache import CacheView, packed_visibility
from specdraft.policy import AutoK, FixedK, StepCosts
from specdraft.run import RunState, StepEvent, add_logprobs, sync_device
from specdraft.sampling import target_rows
from specdraft.verify import Verdict, verify, verify_greedy_chains


@dataclass(frozen=True)
class Plan:
    """Who drafts a sequence's step, how many tokens, and how many committed tokens it must read first."""

    source: str | None
    k: int
    unread: int


PLAIN = Plan(None, 0, 0)


@dataclass
class Seq:
    """A sequence that steps: its run state, drafter and policy; `unscored` counts the tokens at its end no pass
    has read (the last committed one, and forced ones after it)."""

    ident: int
    run: RunState
    drafter: Drafter | None  # None: plain decoding
    policy: FixedK | AutoK | None  # what chooses its k and learns from its steps
    fixed: FixedK | None = None  # a batch sequence's fixed k: it plans by this, its `policy` still learns
    kv_bytes: int = 0  # the cache memory reserved for it (`BatchedDecoder.kv_need`)
    unscored: int = 1

    @property
    def planner(self) -> FixedK | AutoK | None:
        """What chooses its k and trims its drafts."""
        return self.fixed or self.policy

    @property
    def reads_features(self) -> bool:
        """Whether its drafter reads the target's final hidden states (`Drafter.features`)."""
        return self.drafter is not None and self.drafter.needs_features


class Faults(dict):
    """The sequences whose own work failed this step: id -> its first error. `strict` (a single request): raise."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict

    def own(self, seq: Seq) -> AbstractContextManager:
        """Work that is `seq`'s alone: an error fails `seq` only, and the step goes on without it."""
        return _RAISE if self.strict else _Own(self, seq)


class _Own(AbstractContextManager):
    """`Faults.own` of a batch: an exception is `seq`'s first error, and goes no further."""

    __slots__ = ("faults", "seq")

    def __init__(self, faults: Faults, seq: Seq) -> None:
        self.faults, self.seq = faults, seq

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, Exception):
            self.faults.setdefault(self.seq.ident, error)
            return True
        return False


_RAISE = nullcontext()  # `Faults.own` of a single request: its errors raise


@dataclass
class Rules:
    """How a driver steps: tree settings; `lockstep`: drafters hand out their model passes to run together (a
    batch's packed draft caches); `costs`: where the target's passes are timed by their width (a batch's, shared by
    its policies; None: each sequence's policy times the pass it verified, as `AutoK.observe` does)."""

    tree_budget: int = 0
    tree_branch: int = 1
    lockstep: bool = False
    costs: StepCosts | None = None
    gated: bool = False  # the auto sequences step plain (a batch where drafting gave less than plain steps)
    crowded: bool = False  # others share the pass: a probe that must first catch up waits
    plan: Callable[[Seq, DraftContext, int, "Rules"], Plan] | None = None  # a sequence's plan (None: `plan_alone`)
    choose: Callable[[list[Seq], list[Plan]], list[int]] | None = None  # a batch's k per sequence (None: the plans')


@dataclass
class Scored:
    """One target pass over the blocks of the sequences stepping."""

    logits: torch.Tensor  # [R, V]: the pass's last R rows
    hidden: torch.Tensor | None  # [T, H] final hidden states, for drafters that read them
    width: int  # T: tokens fed
    starts: list[int]  # where each sequence's block begins among the T

    def span(self, i: int, seq: Seq) -> slice:
        """Where sequence i's k + 1 rows lie in `logits`: after its last committed token, then each draft token."""
        skipped = self.width - self.logits.shape[0]  # leading tokens whose rows the pass did not keep
        end = self.starts[i + 1] if i + 1 < len(self.starts) else self.width
        return slice(self.starts[i] + seq.unscored - 1 - skipped, end - skipped)

    def rows(self, i: int, seq: Seq) -> torch.Tensor:
        """Sequence i's rows [k + 1, V] (`span`)."""
        return self.logits[self.span(i, seq)]


@dataclass
class Decision:
    """A sequence's verdict on the host: `path` the accepted draft nodes (root to leaf), `accepted` their tokens."""

    num_accepted: int
    next_token: int  # the recovered or bonus token
    bonus: bool
    path: list[int]
    accepted: list[int]


@dataclass(frozen=True)
class Timed:
    """Which parts of a step ran without capturing a CUDA graph (a cost no later step pays), so their times are
    learnt: the drafts, and the target's pass."""

    drafts: bool = True
    scoring: bool = True


@dataclass
class Stepped:
    """What `take_step` did: each sequence's event; the pass's width (0: none ran) and seconds, whether they were
    timed (no CUDA graph captured), and the draft tokens verified."""

    events: list[tuple[int, StepEvent]]
    width: int = 0
    pass_seconds: float = 0.0
    timed: bool = False
    drafted: int = 0


def choose_source(drafter: Drafter, policy: FixedK | AutoK, ctx: DraftContext, limit: int, remaining: int,
                  generated: int) -> tuple[str | None, int, int]:
    """Who drafts this step, how many tokens, and how many committed tokens it must read first: the first source
    the drafter offers that the policy finds worth a draft (a composed drafter offers its parts in order);
    (None, 0, 0) = plain. `remaining`: the budget left; `generated`: the answer's tokens so far."""
    declined: set[str] = set()
    while limit > 0:
        source = drafter.source(ctx, frozenset(declined))
        if source is None or source in declined:
            break
        unread = drafter.unread(ctx)
        k = policy.choose(limit, source, unread=unread, remaining=remaining, generated=generated)
        if k > 0:
            return source, k, unread
        declined.add(source)
    return None, 0, 0


def force(seq: Seq, target: CausalLM) -> StepEvent | None:
    """0. The tokens a sequence's grammar alone decides (without logprobs, which need a pass), appended unscored
    to lead its next block; None when its next token has a choice."""
    if seq.run.grammar is None or seq.run.logprobs is not None:
        return None
    forced = seq.run.force(target.eos_token_ids, target.max_context)
    if forced is not None:
        seq.unscored += len(forced.token_ids)
    return forced


def draft_room(seq: Seq, context: int, rules: Rules) -> tuple[DraftContext, int]:
    """What the sequence's drafter may read, and the most draft tokens it may take (a tree: nodes): within its
    budget and the context, a chain at most its planner's depth, a tree the tree budget and at most that deep."""
    run, planner = seq.run, seq.planner
    room = max(0, context - run.sequence.shape[0] - 1)  # draft tokens the context holds
    depth = min(run.max_new_tokens - len(run.generated) - 1, room)  # the deepest a draft may go and be emitted
    deepest = depth if planner is None else min(depth, planner.max_depth)
    limit = (min(rules.tree_budget, room) if depth > 0 else 0) if rules.tree_budget else deepest
    return DraftContext(run.sequence, run.params, run.generator, run.seen,
                        tree_branch=rules.tree_branch if rules.tree_budget else 1, max_depth=deepest,
                        grammar=run.grammar), limit


def plan_alone(seq: Seq, ctx: DraftContext, limit: int, rules: Rules) -> Plan:
    """1. The sequence's plan as if it ran alone: its planner's choice (`choose_source`: probes included). Plain
    without a drafter, room or, for a drafter that reads features, a pass over forced tokens; plain too for an auto
    sequence while `rules.gated`, and for a probe that must first catch up while `rules.crowded`."""
    drafter, run = seq.drafter, seq.run
    if (drafter is None or limit <= 0 or (rules.gated and seq.fixed is None)
            or (seq.unscored > 1 and drafter.needs_features)):  # features of forced tokens come from a pass
        return PLAIN
    plan = Plan(*choose_source(drafter, seq.planner, ctx, limit, run.max_new_tokens - len(run.generated),
                               len(run.generated)))
    if rules.crowded and plan.k and plan.unread and seq.fixed is None and seq.policy.estimates(plan.source).probing:
        # A probe that must first catch up stalls every sequence of the pass, where drafting pays least: it waits
        # until the sequence runs alone (measured: batches of 4 at 0.95x plain batching with such probes).
        seq.policy.estimates(plan.source).probing = False
        return PLAIN
    return plan


def propose(stepping: list[Seq], contexts: list[DraftContext], plans: list[Plan], ks: list[int], rules: Rules,
            faults: Faults) -> tuple[list[Draft | None], list[float]]:
    """2. Every sequence's draft of its k tokens (k = 0: none), trimmed by its planner and its grammar, and the
    seconds each took. With `rules.lockstep` the drafters' model passes (`Drafter.propose_steps`) run together: the
    passes asked of one packed draft cache at a step go through it at once (`PackedCache.run`), the longest feed
    first, each charged the pass's time by its tokens; a first read (which must lead its pass:
    `kernels.prompt_pass`) runs alone. A sequence whose drafter, or a pass of its own, raises has no draft (None);
    a shared pass that raises fails all its sequences (its packed cache drops what it wrote)."""
    drafts: list[Draft | None] = [None] * len(stepping)
    seconds = [0.0] * len(stepping)
    steps, asked = {}, {}

    def advance(i: int, logits: torch.Tensor | None) -> None:  # send the logits on; the draft if it is done
        began = time.perf_counter()
        asked.pop(i, None)
        with faults.own(stepping[i]):
            try:
                asked[i] = next(steps[i]) if logits is None else steps[i].send(logits)
            except StopIteration as done:
                drafts[i] = done.value
        seconds[i] += time.perf_counter() - began

    for i, (seq, ctx, k) in enumerate(zip(stepping, contexts, ks)):
        if k == 0:
            drafts[i] = Draft.chain(ctx.sequence.new_empty(0))
        elif rules.lockstep:
            with faults.own(seq):
                steps[i] = seq.drafter.propose_steps(ctx, k)
            if i in steps:
                advance(i, None)
        else:
            began = time.perf_counter()
            with faults.own(seq):
                drafts[i] = seq.drafter.propose(ctx, k)
            seconds[i] += time.perf_counter() - began
    while asked:
        _run_draft_passes(stepping, asked, seconds, faults, advance)
    for i, (seq, draft, plan) in enumerate(zip(stepping, drafts, plans)):
        if draft is not None and draft.k:
            began = time.perf_counter()
            with faults.own(seq):
                drafts[i] = _trimmed(seq, draft, plan.source)
            seconds[i] += time.perf_counter() - began
    return drafts, seconds


def _run_draft_passes(stepping: list[Seq], asked: dict, seconds: list[float], faults: Faults,
                      advance: Callable[[int, torch.Tensor], None]) -> None:
    """Run the draft passes asked this round (`propose`): those of one packed cache together, the others alone,
    and send each drafter its logits."""
    together: dict[int, list[int]] = {}
    answers: dict[int, torch.Tensor] = {}
    for i, request in asked.items():
        if isinstance(request.model, CacheView) and not request.prompt:
            together.setdefault(id(request.model.packed), []).append(i)
            continue
        began = time.perf_counter()
        with faults.own(stepping[i]):
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
            if faults.strict:
                raise
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


def _trimmed(seq: Seq, draft: Draft, source: str | None) -> Draft:
    """The prefix of a scored draft (a tree, a `suffix` chain) worth verifying, by the sequence's planner (a fixed
    k verifies all); under a constraint, without the point masses its grammar forbids (drawn tokens stay: the
    verifier rejects them)."""
    if draft.scores is not None:  # any prefix holding the drawn tokens verifies exactly
        draft = draft.prefix(seq.planner.trim(draft.scores, source, draft.must_keep))
    return draft if seq.run.grammar is None else draft.allowed_by(seq.run.grammar)


def score(target: CausalLM, stepping: list[Seq], drafts: list[Draft], row_owner: list[int] | None) -> Scored:
    """3. One target pass over every sequence's block [its unscored tokens, d1 .. dk] (a tree: by depth), each
    at its own positions, seeing its own rows and its block's earlier tokens (a tree: its ancestors). `row_owner`:
    whose each cache row is, for a packed cache; None where the cache holds the one sequence's rows alone."""
    blocks = [torch.cat([seq.run.sequence[-seq.unscored :], draft.tokens]) for seq, draft in zip(stepping, drafts)]
    tokens = torch.cat(blocks) if len(blocks) > 1 else blocks[0]  # [T]
    attention = [draft.block_attention(seq.unscored) for seq, draft in zip(stepping, drafts)]
    starts = [0]
    for block in blocks[:-1]:
        starts.append(starts[-1] + block.shape[0])
    if row_owner is None:
        offsets, visible = attention[0]  # [T], [T, T] (a chain: None, None)
    else:
        offsets, visible = _packed_attention(target.cache_len, stepping, blocks, attention, row_owner)
    # the furthest token: a sequence's length (its unscored tokens counted) plus its draft's depth
    reach = max(seq.run.sequence.shape[0] + draft.height for seq, draft in zip(stepping, drafts))
    width = tokens.shape[0]
    keep = width if row_owner is not None else width - stepping[0].unscored + 1  # alone: [k + 1] rows
    out = target.forward(tokens.unsqueeze(0), keep,
                         hidden_to_keep=width if any(seq.reads_features for seq in stepping) else 0,
                         offsets=offsets, visible=visible, reach=reach)
    return Scored(out.logits[0], out.hidden_states[0] if out.hidden_states is not None else None, width, starts)


def _packed_attention(cached: int, stepping: list[Seq], blocks: list[torch.Tensor], attention: list[tuple],
                      row_owner: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets [T] (after the cache's `cached` rows) and visibility [T, cached + T] of a pass over a packed cache:
    each token at its sequence's positions, seeing its sequence's rows and its block's earlier tokens (a tree's
    tokens: the root and their own ancestors)."""
    owners = [seq.ident for seq, block in zip(stepping, blocks) for _ in range(block.shape[0])]
    which = [i for i, block in enumerate(blocks) for _ in range(block.shape[0])]
    positions = torch.cat([seq.run.sequence.shape[0] - seq.unscored + (
        offsets if offsets is not None else torch.arange(block.shape[0], device=block.device))
        for seq, block, (offsets, _) in zip(stepping, blocks, attention)])  # [T]
    visible = packed_visibility(row_owner, owners, which, blocks[0].device)  # [T, cached + T]
    start = cached
    for block, (_, tree) in zip(blocks, attention):
        if tree is not None:
            visible[start - cached : start - cached + block.shape[0], start : start + block.shape[0]] = tree
        start += block.shape[0]
    return positions - cached, visible


def verify_all(stepping: list[Seq], drafts: list[Draft], scored: Scored, faults: Faults) -> list[Decision | None]:
    """4. Each sequence's verdict (`verify`), all read in one host sync: greedy chains without penalty or constraint
    together (`verify_greedy_chains`, on the logits), the others each as alone on their target rows (warped, masked
    by its grammar). None for a sequence whose verification raised."""
    verdicts: list[Verdict | None] = [None] * len(stepping)
    together = [i for i, (seq, draft) in enumerate(zip(stepping, drafts))
                if seq.run.params.greedy and seq.run.seen is None and seq.run.grammar is None and draft.is_chain]
    for i, (seq, draft) in enumerate(zip(stepping, drafts)):
        if i in together:
            continue
        run = seq.run
        with faults.own(seq):
            block = torch.cat([run.sequence[-1:], draft.tokens])  # [k + 1]: the rows' tokens
            p_target = target_rows(run.masked(scored.rows(i, seq), draft), run.params, run.seen, block,
                                   draft.rows_ancestors())  # [k + 1, V]
            verdicts[i] = verify(draft, p_target, None if run.params.greedy else run.generator)
    heads: dict[int, torch.Tensor] = {}  # per sequence: [num_accepted, next_token, deepest]
    if together:  # the target's argmax: of every row in one go when all are greedy chains, else of theirs
        whole = scored.logits.argmax(-1) if len(together) == len(stepping) else None  # [R]
        choices = [whole[scored.span(i, stepping[i])] if whole is not None else scored.rows(i, stepping[i]).argmax(-1)
                   for i in together]  # each [k + 1]
        chains = verify_greedy_chains([drafts[i].tokens for i in together], choices)
        rows = torch.stack([chains.num_accepted, chains.next_token, chains.deepest()], 1)  # [G, 3]
        heads.update(zip(together, rows))
    for i, verdict in enumerate(verdicts):
        if verdict is not None:
            heads[i] = torch.cat([verdict.num_accepted[:1], verdict.next_token[:1], verdict.deepest()[:1]])
    live = sorted(heads)
    host = torch.cat([heads[i] for i in live] + [drafts[i].tokens for i in live]).tolist()  # the step's one sync
    decisions: list[Decision | None] = [None] * len(stepping)
    at = 3 * len(live)
    for n, i in enumerate(live):
        draft = drafts[i]
        num_accepted, next_token, deepest = host[3 * n : 3 * n + 3]
        path = draft.path(deepest)
        decisions[i] = Decision(num_accepted, next_token, draft.is_bonus(deepest), path,
                                [host[at + node] for node in path])
        at += draft.k
    return decisions


def commit(target: CausalLM, stepping: list[Seq], drafts: list[Draft], decisions: list[Decision | None],
           scored: Scored, faults: Faults, row_owner: list[int] | None) -> None:
    """5. The cache keeps, of the pass, each verified sequence's unscored rows and accepted path (a drafter that
    reads features gets those rows' states first); then each drafter learns what was kept (`Drafter.commit`)."""
    cached = target.cache_len - scored.width
    kept_rows, owners = [], []
    for i, (seq, decision) in enumerate(zip(stepping, decisions)):
        if decision is None:
            continue
        kept = [scored.starts[i] + row for row in range(seq.unscored)]
        kept += [scored.starts[i] + seq.unscored + node for node in decision.path]
        with faults.own(seq):
            if seq.reads_features:  # the kept rows' states, before commit
                seq.drafter.features(scored.hidden[kept])
        if seq.ident not in faults:
            kept_rows += kept
            owners += [seq.ident] * len(kept)
    target.keep(cached, kept_rows)
    if row_owner is not None:
        row_owner += owners
    for seq, draft, decision in zip(stepping, drafts, decisions):
        if decision is not None and draft.k and seq.ident not in faults:
            with faults.own(seq):
                seq.drafter.commit(seq.run.sequence.shape[0], decision.path)


def emit(target: CausalLM, stepping: list[Seq], drafts: list[Draft], plans: list[Plan],
         decisions: list[Decision | None], scored: Scored, draft_seconds: list[float], verify_seconds: float,
         pass_timed: bool, timed: Timed, faults: Faults) -> list[tuple[int, StepEvent]]:
    """6. Each verified sequence's event (`RunState.emit`: cut at EOS, a stop string or the budget), with its
    log-probabilities from the rows that decided its tokens; its policy and statistics learn from the step (its
    policy times the pass too unless `pass_timed`: the driver did; `timed`: the parts whose times are learnt)."""
    events = []
    for i, (seq, draft, plan, decision) in enumerate(zip(stepping, drafts, plans, decisions)):
        if decision is None or seq.ident in faults:
            continue
        run, k, path = seq.run, draft.k, decision.path
        with faults.own(seq):
            if seq.drafter is not None:
                seq.policy.observe(k, decision.num_accepted, draft_seconds[i], None if pass_timed else verify_seconds,
                                   plan.source, path, plan.unread, draft.scores, timed=timed.scoring,
                                   drafts_timed=timed.drafts)
            event = run.emit(k, decision.accepted, decision.next_token, decision.bonus, target.eos_token_ids,
                             target.max_context)
            run.stats.record_step(k, event.accepted, plan.source if k else None, path, draft.height,
                                  draft_seconds[i], verify_seconds)
            run.stats.new_tokens, run.stats.wall_seconds = len(run.generated), time.perf_counter() - run.started
            if run.logprobs is not None:  # the rows that decided the emitted tokens: the root's, then the path's
                decided = ([0] + [1 + node for node in path])[: len(event.token_ids)]
                add_logprobs(event, scored.rows(i, seq)[decided], run.logprobs)
            seq.unscored = 1  # the pass read everything but the token it emitted last
            events.append((seq.ident, event))
    return events


def take_step(target: CausalLM, stepping: list[Seq], rules: Rules, faults: Faults,
              row_owner: list[int] | None = None) -> Stepped:
    """plan -> propose -> score -> verify -> commit -> emit for the sequences `stepping` (module doc). `row_owner`:
    the packed cache's owners, kept in step with it (None: the cache is the one sequence's). What serves them all
    (the target pass, the cache's keep) raises."""
    sync_device(target.device)  # work queued before the step (a batch's prompt read) is not the drafts' time
    t0, captures = time.perf_counter(), graphs_captured()
    contexts, plans, plan = [], [], rules.plan or plan_alone
    for seq in stepping:  # 1. plan: each as if alone, then the driver's rule
        ctx, limit = draft_room(seq, target.max_context, rules)
        contexts.append(ctx)
        plans.append(PLAIN)
        with faults.own(seq):
            plans[-1] = plan(seq, ctx, limit, rules)
    ks = rules.choose(stepping, plans) if rules.choose is not None else [plan.k for plan in plans]
    drafts, seconds = propose(stepping, contexts, plans, ks, rules, faults)  # 2. propose
    well = [i for i, seq in enumerate(stepping) if seq.ident not in faults]  # those still in the step
    if not well:
        return Stepped([])
    stepping, plans, drafts, seconds = ([column[i] for i in well] for column in (stepping, plans, drafts, seconds))
    sync_device(target.device)
    t1, drafted = time.perf_counter(), graphs_captured()
    scored = score(target, stepping, drafts, row_owner)  # 3. score
    decisions = verify_all(stepping, drafts, scored, faults)  # 4. verify
    t2 = time.perf_counter()
    commit(target, stepping, drafts, decisions, scored, faults, row_owner)  # 5. commit
    # what captured a CUDA graph is not timed: the drafts and the pass apart (a first pass of a width must not keep
    # the drafts' cost from being learnt, or a batch would price drafting by its guess for good)
    timed = Timed(drafts=drafted == captures, scoring=graphs_captured() == drafted)
    if rules.costs is not None and timed.scoring:
        rules.costs.time_pass(scored.width, t2 - t1)
    shared = (t1 - t0 - sum(seconds)) / len(stepping)  # planning, and waiting for queued draft passes
    events = emit(target, stepping, drafts, plans, decisions, scored, [s + shared for s in seconds], t2 - t1,
                  rules.costs is not None, timed, faults)  # 6. emit
    return Stepped(events, scored.width, t2 - t1, timed.drafts and timed.scoring, sum(draft.k for draft in drafts))
