"""Speculative decoding of one request: prefill, then the step (`step.py`) until the answer stops.

```
prefill(prompt[:-1])                               # target and drafter
while not done:
    forced  = grammar's forced run                 # 0. tokens the constraint alone decides (no pass)
    draft   = drafter.propose(ctx, k)              # 1.-2. plan and propose
    logits  = target.forward([last] + draft)       # 3. score every draft position at once
    verdict = verify(draft, logits, sampling)      # 4. accept, then recover or bonus
    commit(verdict)                                # 5. caches keep the accepted prefix
    yield the committed tokens, cut at EOS / stop string / budget   # 6. emit
```

The request is a batch of one: `step.take_step` is the step `batch_engine.BatchedDecoder` runs for many, here over
the target's own cache (no packing, no mask for a chain). Without a drafter the same loop is plain autoregressive
decoding (`ar`): each step drafts nothing and the target's own token is the whole commitment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from specdraft.constraints import Constraint
from specdraft.drafters import make_drafter
from specdraft.drafters.base import Drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.policy import AUTO, GPU_MAX_AUTO_K, AutoK, FixedK, make_policy
from specdraft.prefix_cache import PrefixCache
from specdraft.run import StepEvent, check_request, start_run, sync_device
from specdraft.sampling import SamplingParams
from specdraft.stats import GenerationStats
from specdraft.step import Faults, Rules, Seq, force, take_step
from specdraft.text import encode_prompt

# Draft tokens per step when none is given: chosen each step by the cost model (policy.py).
DEFAULT_K = AUTO
# Children per node of a tree draft when --tree-budget is set and --tree-branch is not.
DEFAULT_TREE_BRANCH = 4


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
            return encode_prompt(self.target.tokenizer, prompt, chat=chat)
        return [int(t) for t in prompt]

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
        target, drafter = self.target, self.drafter
        prompt_ids = self._prompt_ids(prompt, chat)
        stops = check_request(target, prompt_ids, max_new_tokens, logprobs, stop)
        run = start_run(target, prompt_ids, sampling or SamplingParams(), max_new_tokens, stops, logprobs, constraint,
                        stats)
        sequence = run.sequence  # [L]
        target.reset()
        wants_features = drafter is not None and drafter.needs_features
        # a feature drafter needs the whole prompt's states
        reused = (self.prefixes.resume(target, sequence[:-1], cache_salt)
                  if self.prefixes is not None and not wants_features else 0)
        run.stats.cached_prompt_tokens = reused
        if wants_features:
            drafter.claim_features()  # the prompt's pass returns the states this drafter reads
        prompt_features = target.prefill(sequence[reused:-1].unsqueeze(0), hidden=wants_features)  # [L - 1, H] or None
        if self.prefixes is not None:
            self.prefixes.keep(target, sequence[:-1], cache_salt)
        if drafter is not None:
            drafter.begin(sequence)
            if wants_features:
                drafter.features(prompt_features)
            self.policy.begin_request()
        sync_device(target.device)
        run.stats.prefill_seconds = time.perf_counter() - run.started
        try:
            yield from self._steps(Seq(0, run, drafter, self.policy))
        finally:
            if drafter is not None:
                drafter.end(sequence.new_tensor(prompt_ids + run.generated))

    def _steps(self, seq: Seq) -> Iterator[StepEvent]:
        """Step the one sequence until it stops: the tokens its grammar alone decides, then `step.take_step`
        (plan -> propose -> score -> verify -> commit -> emit) over the target's cache, which holds its rows alone."""
        target, faults = self.target, Faults(strict=True)
        rules = Rules(self.tree_budget, self.tree_branch)  # its policy times each pass (`AutoK.observe`)
        while True:
            forced = force(seq, target)  # 0. tokens the grammar alone decides
            if forced is not None:
                yield forced
                if forced.finish_reason is not None:
                    return
            [(_, event)] = take_step(target, [seq], rules, faults).events
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
