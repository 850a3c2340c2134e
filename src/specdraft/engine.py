"""The speculative decoding loop: propose, score all at once, verify, commit.

```
prefill(prompt[:-1])                               # target and drafter
while not done:
    draft   = drafter.propose(ctx, k)              # 1. propose
    logits  = target.forward([last] + draft)       # 2. score every draft position at once
    verdict = verify(draft, logits, sampling)      # 3. accept, then recover or bonus
    commit(verdict)                                # 4. caches keep the accepted prefix
    yield the committed tokens, cut at EOS / stop string / budget
```

Without a drafter the same loop is plain autoregressive decoding (`ar`): each step drafts
nothing and the target's own token is the whole commitment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from specdraft.constraints import Constraint, GrammarState, start_grammar
from specdraft.drafters import make_drafter
from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.graph_decoder import graphs_captured
from specdraft.policy import AUTO, GPU_MAX_AUTO_K, AutoK, FixedK, make_policy
from specdraft.prefix_cache import PrefixCache
from specdraft.sampling import SamplingParams, target_rows
from specdraft.stats import GenerationStats
from specdraft.text import IncrementalText, encode_prompt
from specdraft.verify import verify

# Draft tokens per step when none is given: chosen each step by the cost model (policy.py).
DEFAULT_K = AUTO
# Children per node of a tree draft when --tree-budget is set and --tree-branch is not.
DEFAULT_TREE_BRANCH = 4

# What happened to each emitted token (FORCED: the constraint's grammar allowed nothing else; no pass decided it).
ACCEPTED, RECOVERED, BONUS, TARGET, FORCED = "accepted", "recovered", "bonus", "target", "forced"
MAX_TOP_LOGPROBS = 20  # alternatives per token a stream may ask for (OpenAI's limit)


@dataclass
class StepEvent:
    """What one step emitted: tokens, what happened to each, and the text they add."""

    token_ids: list[int]
    kinds: list[str]  # ACCEPTED / RECOVERED / BONUS, or TARGET when nothing was drafted, or FORCED
    pieces: list[str]  # text each token adds (never splits a character, never shows part of a stop string)
    drafted: int
    accepted: int
    finish_reason: str | None = None  # "stop" or "length" on the last event
    # With `stream(logprobs=N)`: each token's log-probability under the target's own distribution (before
    # temperature, top-k and top-p), and its N most likely alternatives as (token id, log-probability).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def text(self) -> str:
        """The text delta of the whole step."""
        return "".join(self.pieces)


@dataclass
class Completion:
    """A finished generation with its statistics."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    kinds: list[str] = field(default_factory=list)


def check_tree_options(tree_budget: int, tree_branch: int) -> None:
    """Refuse a tree budget < 0 (0 = chains) or fewer than 1 child per node, naming the option."""
    for name, value, least in (("tree-budget", tree_budget, 0), ("tree-branch", tree_branch, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise SpecdraftError(f"--{name} must be an integer >= {least}, got {value!r}.")


def add_logprobs(event: StepEvent, logits: torch.Tensor, top: int) -> None:
    """Fill `event`'s log-probabilities from the target's logits that decided its tokens. logits: [n, V]."""
    log_p = logits.float().log_softmax(-1)  # [n, V]
    chosen = torch.tensor(event.token_ids, device=log_p.device).unsqueeze(-1)  # [n, 1]
    event.logprobs = log_p.gather(-1, chosen).squeeze(-1).tolist()
    values, ids = log_p.topk(top, dim=-1) if top else (log_p[:, :0], log_p[:, :0].long())  # [n, top]
    event.top_logprobs = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]


def sync_device(device: torch.device) -> None:
    """Wait for queued device work (CUDA), so a wall-clock reading covers it; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RunState:
    """One request's state while it generates."""

    sequence: torch.Tensor  # [L] committed tokens, the prompt first
    seen: torch.Tensor | None  # [V] bool: tokens of the sequence (repetition penalty only)
    params: SamplingParams
    generator: torch.Generator
    max_new_tokens: int
    text: IncrementalText
    stats: GenerationStats
    started: float  # perf_counter() at the request's start
    logprobs: int | None
    grammar: GrammarState | None = None  # the answer's constraint, where it has one
    generated: list[int] = field(default_factory=list)

    def full(self, context: int) -> bool:
        """Whether the answer has its budget of new tokens or the sequence fills the model's `context`."""
        return len(self.generated) >= self.max_new_tokens or self.sequence.shape[0] >= context

    def extend(self, committed: list[int]) -> None:
        """Append a step's emitted tokens to the sequence (and to what the repetition penalty and the constraint
        have seen)."""
        self.generated.extend(committed)
        tokens = self.sequence.new_tensor(committed)  # [n]
        self.sequence = torch.cat([self.sequence, tokens])
        if self.seen is not None:
            self.seen[tokens] = True
        if self.grammar is not None:
            self.grammar.commit(committed)

    def emit(self, k: int, accepted_tokens: list[int], next_token: int, bonus: bool, eos_ids: set[int],
             context: int) -> StepEvent:
        """Commit a verified step (`k` drafted, `accepted_tokens` kept, then the target's `next_token`: a bonus
        or a recovery) cut at EOS, a stop string or the budget, and return its event (finish_reason set on the
        last one)."""
        kinds = [ACCEPTED] * len(accepted_tokens) + [TARGET if k == 0 else BONUS if bonus else RECOVERED]
        return self._append(accepted_tokens + [next_token], kinds, k, len(accepted_tokens), eos_ids, context)

    def force(self, eos_ids: set[int], context: int) -> StepEvent | None:
        """Append the run of tokens the constraint's grammar alone decides (one legal token each: the masked
        target's only choice), within the budget; None when the next token has a choice."""
        room = min(self.max_new_tokens - len(self.generated), context - self.sequence.shape[0])
        tokens = self.grammar.forced_run((), room)
        if not tokens:
            return None
        event = self._append(tokens, [FORCED] * len(tokens), 0, 0, eos_ids, context)
        self.stats.forced_tokens += len(event.token_ids)
        self.stats.new_tokens, self.stats.wall_seconds = len(self.generated), time.perf_counter() - self.started
        return event

    def masked(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """A verification pass's rows [k + 1, V] under the constraint: row 0 after the committed sequence, row
        1 + i after draft token i's path (the logits themselves without one)."""
        return logits if self.grammar is None else self.grammar.mask_rows(logits, [()] + draft.paths())

    def _append(self, tokens: list[int], kinds: list[str], drafted: int, accepted: int, eos_ids: set[int],
                context: int) -> StepEvent:
        """Commit `tokens` (the first `accepted` of them draft tokens) cut at EOS, a stop string or the budget."""
        committed, texts, finish = self.text.cut(self.generated, tokens, eos_ids)
        self.extend(committed)
        if self.grammar is not None:
            self.stats.mask_seconds = self.grammar.mask_seconds
        if finish is None and self.full(context):
            finish = "length"
        pieces = [self.text.delta(t, final=finish is not None and j == len(texts) - 1) for j, t in enumerate(texts)]
        kept = min(accepted, len(committed))
        return StepEvent(committed, kinds[: len(committed)], pieces, drafted, kept, finish)


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


class SpeculativeDecoder:
    """Generates with `target`, drafting with `drafter` (None = plain autoregressive decoding).

    `k` is the number of draft tokens per step: an integer, `"auto"` (chosen each step by a
    cost model of this machine, see `policy.AutoK`), or a policy object (e.g. an `AutoK`
    shared by several decoders, so its measurements carry over). The decoder is not
    thread-safe: one request at a time (the caches belong to it).

    `prefixes` (optional, may be shared by decoders over the same target): prompts read before, so a prompt that
    begins like one of them reads only the rest (`prefix_cache`); only where that is exact
    (`CausalLM.reads_split_exactly`), else SpecdraftError.
    """

    def __init__(self, target: CausalLM, drafter: Drafter | None = None,
                 k: int | str | FixedK | AutoK = DEFAULT_K, tree_budget: int = 0,
                 tree_branch: int = DEFAULT_TREE_BRANCH, prefixes: PrefixCache | None = None) -> None:
        check_tree_options(tree_budget, tree_branch)
        if prefixes is not None and not target.reads_split_exactly:
            raise SpecdraftError(f"{target.name} does not read prompts in splits exactly here (that needs packed GGUF "
                                 "weights on the CPU's fused kernels, bf16, grouped attention, not AMX), so a prefix "
                                 "cache would change its answers; run without one.")
        self.prefixes = prefixes
        self.target = target
        self.drafter = drafter
        self.tree_budget, self.tree_branch = tree_budget, tree_branch
        self.policy = (k if isinstance(k, (FixedK, AutoK)) else make_policy(k, tree_budget)
                       if drafter is not None else None)
        if isinstance(self.policy, AutoK) and target.device.type == "cuda":
            self.policy.widen(GPU_MAX_AUTO_K)

    @property
    def method(self) -> str:
        return "ar" if self.drafter is None else "spec"

    # ------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int], chat: bool | None) -> list[int]:
        if isinstance(prompt, str):
            ids = encode_prompt(self.target.tokenizer, prompt, chat=chat)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise SpecdraftError("The prompt is empty; give at least one token.")
        if len(ids) >= self.target.max_context:
            raise SpecdraftError(
                f"The prompt has {len(ids)} tokens, but {self.target.name} holds {self.target.max_context} "
                "in all; shorten the prompt."
            )
        vocab = self.target.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise SpecdraftError(f"Prompt token ids must lie in [0, {vocab}); got one outside.")
        return ids

    def stream(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        stats: GenerationStats | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        cache_salt: str = "",
    ) -> Iterator[StepEvent]:
        """Generate step by step; each event carries the tokens and text one step committed.

        `stats` (optional) is filled in as the generation goes; `generate` returns it. `logprobs` N
        (0 to MAX_TOP_LOGPROBS) adds each token's log-probability and its N most likely alternatives
        to the events, read from the verification pass that decided the token (no extra pass).
        `constraint`: the answer must match it (`constraints`); tokens its grammar alone decides come as
        events of their own (kind FORCED, no pass), except with `logprobs`, where every token is scored.
        `cache_salt`: the prompt shares the prefix cache's rows only with prompts read under the same salt.
        """
        params = sampling or SamplingParams()
        if max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise SpecdraftError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}.")
        stops = [s for s in stop if s]
        if stops and self.target.tokenizer is None:
            raise SpecdraftError("Stop strings need a tokenizer to decode the output; this model has none.")
        prompt_ids = self._prompt_ids(prompt, chat)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt_ids)
        target, drafter, device = self.target, self.drafter, self.target.device
        grammar = start_grammar(constraint, target)
        generator = params.make_generator(device)
        text = IncrementalText(target.tokenizer, stops)

        started = time.perf_counter()
        sequence = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [L]
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)
            seen[sequence] = True
        target.reset()
        wants_features = drafter is not None and drafter.needs_features
        # a feature drafter needs the whole prompt's states
        reused = (self.prefixes.resume(target, sequence[:-1], cache_salt)
                  if self.prefixes is not None and not wants_features else 0)
        stats.cached_prompt_tokens = reused
        prompt_features = target.prefill(sequence[reused:-1].unsqueeze(0), hidden=wants_features)  # [L - 1, H] or None
        if self.prefixes is not None:
            self.prefixes.keep(target, sequence[:-1], cache_salt)
        if drafter is not None:
            drafter.begin(sequence)
            if wants_features:
                drafter.features(prompt_features)
            self.policy.begin_request()
        sync_device(device)
        stats.prefill_seconds = time.perf_counter() - started

        run = RunState(sequence, seen, params, generator, max_new_tokens, text, stats, started, logprobs, grammar)
        try:
            yield from self._steps(run)
        finally:
            if drafter is not None:
                drafter.end(sequence.new_tensor(prompt_ids + run.generated))

    def _propose(self, run: "RunState") -> tuple[Draft, str | None, int]:
        """This step's draft (empty for a plain step), who drafted it, and how many committed tokens it read."""
        remaining = run.max_new_tokens - len(run.generated)
        room = max(0, self.target.max_context - run.sequence.shape[0] - 1)  # draft tokens the context holds
        depth = min(remaining - 1, room)  # the deepest a draft may go and still be emitted
        limit = depth if not self.tree_budget else min(self.tree_budget, room) if depth > 0 else 0
        unscored = run.sequence.shape[0] - self.target.cache_len - 1  # forced tokens no pass has read yet
        if self.drafter is None or (unscored and self.drafter.needs_features):  # features come from a pass
            return Draft.chain(run.sequence.new_empty(0)), None, 0
        ctx = DraftContext(run.sequence, run.params, run.generator, run.seen,
                           tree_branch=self.tree_branch if self.tree_budget else 1,
                           max_depth=min(depth, self.policy.max_depth), grammar=run.grammar)
        source, k, unread = choose_source(self.drafter, self.policy, ctx, limit, remaining, len(run.generated))
        if k == 0:
            return Draft.chain(run.sequence.new_empty(0)), None, 0
        draft = self.drafter.propose(ctx, k)
        if draft.scores is not None:  # any prefix holding the drawn tokens verifies exactly
            draft = draft.prefix(self.policy.trim(draft.scores, source, draft.must_keep))
        if run.grammar is not None:  # point masses the grammar forbids go (drawn tokens stay: the verifier rejects them)
            draft = draft.allowed_by(run.grammar)
        return draft, source, unread

    def _commit(self, run: "RunState", draft: Draft, path: list[int], hidden: torch.Tensor | None) -> None:
        """Both caches keep the accepted path; a feature drafter reads the kept rows' hidden states [u + a, H] (the
        block's u committed tokens: the last one, after forced tokens those too; then the path's)."""
        length = run.sequence.shape[0]
        self.target.keep(length, path)
        if hidden is not None:
            unread = hidden.shape[0] - draft.k
            self.drafter.features(hidden[list(range(unread)) + [unread + node for node in path]])
        if draft.k > 0:
            self.drafter.commit(length, path)

    def _steps(self, run: "RunState") -> Iterator[StepEvent]:
        """propose -> score -> verify -> commit -> emit, until the answer stops."""
        target, drafter = self.target, self.drafter
        wants_features = drafter is not None and drafter.needs_features
        while True:
            if run.grammar is not None and run.logprobs is None:  # 0. tokens the grammar alone decides
                forced = run.force(target.eos_token_ids, target.max_context)
                if forced is not None:
                    yield forced
                    if forced.finish_reason is not None:
                        return
            t0, captures = time.perf_counter(), graphs_captured()
            draft, source, unread = self._propose(run)  # 1. propose
            k, tree = draft.k, draft.layout
            sync_device(target.device)
            t1 = time.perf_counter()
            # 2. score every draft position in one target pass: [unread committed .., last, d1 .. dk] (a tree: by depth)
            block = torch.cat([run.sequence[target.cache_len :], draft.tokens])  # [T]
            offsets, visible = tree.block_attention(block.shape[0] - k) if tree is not None else (None, None)
            scored = target.forward(block.unsqueeze(0), k + 1, hidden_to_keep=block.shape[0] if wants_features else 0,
                                    offsets=offsets, visible=visible)
            logits = scored.logits[0]  # [k + 1, V]: row j predicts after [last, d1 .. dk][j]
            p_target = target_rows(run.masked(logits, draft), run.params, run.seen, block[block.shape[0] - k - 1 :],
                                   None if tree is None else tree.rows_ancestors())  # [k + 1, V]
            verdict = verify(draft, p_target, None if run.params.greedy else run.generator)  # 3. verify
            # The one host sync of the step: [num_accepted, next_token, deepest accepted node, d1 .. dk].
            decided = torch.cat([verdict.num_accepted[:1], verdict.next_token[:1], verdict.deepest()[:1],
                                 draft.tokens]).tolist()
            num_accepted, next_token, deepest = decided[:3]
            path = tree.path(deepest) if tree is not None else list(range(num_accepted))
            t2 = time.perf_counter()
            self._commit(run, draft, path, scored.hidden_states[0] if wants_features else None)  # 4. commit
            bonus = tree.is_leaf(deepest) if tree is not None else num_accepted == k
            event = run.emit(k, [decided[3 + node] for node in path], next_token, bonus, target.eos_token_ids,
                             target.max_context)  # 5. emit, cut at EOS, a stop string or the budget
            if drafter is not None:
                self.policy.observe(k, num_accepted, t1 - t0, t2 - t1, source, path, unread, draft.scores,
                                    timed=graphs_captured() == captures)
            run.stats.record_step(k, event.accepted, source if k > 0 else None, path,
                                  tree.height if tree is not None else k, t1 - t0, t2 - t1)
            run.stats.new_tokens, run.stats.wall_seconds = len(run.generated), time.perf_counter() - run.started
            if run.logprobs is not None:  # from the rows that decided the emitted tokens
                add_logprobs(event, logits[([0] + [1 + node for node in path])[: len(event.token_ids)]], run.logprobs)
            yield event
            if event.finish_reason is not None:
                return

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        constraint: Constraint | None = None,
    ) -> Completion:
        """Generate to the end and return the completion with its statistics (`constraint`: as `stream`)."""
        stats = GenerationStats()
        prompt_ids = self._prompt_ids(prompt, chat)
        token_ids, kinds, pieces, finish = [], [], [], "length"
        for event in self.stream(prompt_ids, sampling, max_new_tokens, stop, chat, stats, constraint=constraint):
            token_ids += event.token_ids
            kinds += event.kinds
            pieces.append(event.text)
            finish = event.finish_reason or finish
        return Completion(prompt_ids, token_ids, "".join(pieces), finish, stats, kinds)


def build_decoder(target: CausalLM, drafter: str | Drafter | None = None, options: dict | None = None, *,
                  draft_model: CausalLM | None = None, k: int | str | FixedK | AutoK = DEFAULT_K, tree_budget: int = 0,
                  tree_branch: int = DEFAULT_TREE_BRANCH, prefixes: PrefixCache | None = None) -> SpeculativeDecoder:
    """The one way the CLI, the server and the bench make a decoder: `drafter` a registered name (parts joined by
    +; built from `options` over its defaults, None values not given, and `draft_model`: an option the drafter does
    not take is an error), a drafter already built, or None for plain decoding; `prefixes` as `SpeculativeDecoder`
    takes it."""
    if drafter is None:
        return SpeculativeDecoder(target, prefixes=prefixes)
    if isinstance(drafter, str):
        drafter = make_drafter(drafter, options, draft_model=draft_model, target_model=target)
    return SpeculativeDecoder(target, drafter, k=k, tree_budget=tree_budget, tree_branch=tree_branch,
                              prefixes=prefixes)
