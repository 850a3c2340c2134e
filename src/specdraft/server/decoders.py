"""The server's speculation settings over the loaded target and draft: what a request may ask for (`resolve`), and
the drafter each of its sequences gets (`drafter_factory`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from specdraft.drafters import (DEFAULT_DRAFTER, DRAFTERS, Drafter, check_not_bench_only, drafter_options, make_drafter,
                                needs_draft_model, remembers_requests)
from specdraft.engine import DEFAULT_K, DEFAULT_TREE_BRANCH, check_tree_options
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.policy import AUTO, GPU_MAX_AUTO_K, FixedK, make_policy

# The drafter name that asks for plain autoregressive decoding (no draft).
PLAIN = "none"
# Memories of earlier requests kept at once, one per cache salt (a `suffix` corpus up to ~100 MB each); the least
# recently used leaves, so requests with ever new cache salts cannot pile them up.
DEFAULT_MAX_MEMORIES = 8


@dataclass(frozen=True)
class DecoderKey:
    """How a request's sequences decode: a drafter name (`none` = plain decoding), k (an integer or `auto`) and, for a
    drafter that learns from earlier requests, the partition of that memory it reads and adds to (its cache salt;
    "" for the others)."""

    drafter: str
    k: int | str
    cache_salt: str = ""


class DecoderPool:
    """The loaded target (and draft, if any) with the server's speculation defaults.

    `resolve` checks a request's speculation settings without touching the models (any thread);
    `drafter_factory` makes its sequences' drafters, and runs on the engine thread only. `max_k`: the largest fixed k
    a request may ask for (the server checks it: `prepare`; by default what one pass can use: on a GPU a pass over
    33 tokens costs about what one token's does, `GPU_MAX_AUTO_K`; past it a step scores [k + 1, V] logits in vain);
    the memories of earlier requests of at most `max_memories` cache salts are kept.
    """

    def __init__(self, target: CausalLM, draft: CausalLM | None = None, drafter: str = DEFAULT_DRAFTER,
                 k: int | str = DEFAULT_K, options: dict[str, Any] | None = None, tree_budget: int = 0,
                 tree_branch: int = DEFAULT_TREE_BRANCH, max_k: int = GPU_MAX_AUTO_K,
                 max_memories: int = DEFAULT_MAX_MEMORIES) -> None:
        check_tree_options(tree_budget, tree_branch)
        if max_k < 1 or max_memories < 1:
            raise SpecdraftError(f"max_k and max_memories must be >= 1, got {max_k} and {max_memories}.")
        self.target, self.draft = target, draft
        self.options = {key: value for key, value in (options or {}).items() if value is not None}
        self.tree_budget, self.tree_branch = tree_budget, tree_branch
        self.max_k, self.max_memories = max_k, max_memories
        # whether drafters that learn from earlier requests may (False: `serve --cross-request-memory off`)
        self.remember = True
        self.default = self.resolve(drafter, k)
        # trained drafters' weights, loaded once for every sequence (`make_drafter`'s `shared`)
        self._shared: dict = {}
        # what drafters learn from earlier requests, by cache salt (`make_drafter`'s `memory`), least recently used first
        self.memories: OrderedDict[str, dict] = OrderedDict()

    def drafters(self) -> list[str]:
        """The drafter names this server can build (`none` included; bench-only tools never); trained ones still
        need their files."""
        usable = [name for name, info in DRAFTERS.items()
                  if not info.bench_only and (self.draft is not None or not info.needs_draft_model)]
        return [PLAIN, *usable]

    def resolve(self, drafter: str | None = None, k: int | str | None = None, cache_salt: str = "") -> DecoderKey:
        """The decoder key for a request's `drafter` and `k` (None = the server's default) and its `cache_salt` (kept
        for a drafter that learns from earlier requests); SpecdraftError when the name is unknown or bench-only,
        needs a draft model this server has not loaded, or k is not a number >= 1."""
        drafter = (drafter or "").strip() or self.default.drafter
        k = self.default.k if k is None else k
        if drafter == PLAIN:
            return DecoderKey(PLAIN, 0)
        check_not_bench_only(drafter)
        if needs_draft_model(drafter) and self.draft is None:
            raise SpecdraftError(f"Drafter {drafter!r} needs a draft model and this server has none loaded; ask for "
                                 f"one of {', '.join(self.drafters())}, or start the server with a drafter that "
                                 "uses the draft model (--drafter model).")
        policy = make_policy(k, self.tree_budget)  # k < 1 or not a number fails here
        salt = cache_salt if self.remember and remembers_requests(drafter) else ""
        return DecoderKey(drafter, policy.k if isinstance(policy, FixedK) else AUTO, salt)

    def _options_for(self, drafter: str) -> dict[str, Any]:
        """The server's drafter options that `drafter` takes (they serve several drafters)."""
        known = drafter_options(drafter)
        return {name: value for name, value in self.options.items() if name in known}

    def _memory(self, key: DecoderKey) -> dict | None:
        """What the drafters of `key`'s cache salt remember of earlier requests (None: nothing is remembered)."""
        if not (self.remember and remembers_requests(key.drafter)):
            return None
        memory = self.memories.pop(key.cache_salt, None)
        self.memories[key.cache_salt] = memory = {} if memory is None else memory
        while len(self.memories) > self.max_memories:
            self.memories.popitem(last=False)
        return memory

    def drafter_factory(self, key: DecoderKey) -> Callable[[], Drafter] | None:
        """What makes a fresh drafter for one sequence of a batch under `key` (None: plain decoding): a draft model
        gets a cache of its own over the loaded weights each time, a trained drafter a state of its own over weights
        loaded once, a drafter that learns from earlier requests the memory of its cache salt (engine thread only)."""
        if key.drafter == PLAIN:
            return None
        draft, memory = self.draft, self._memory(key)

        def make() -> Drafter:
            # its cache is never filled: the batch packs every sequence's draft rows into one (`batch_engine`)
            own = None if draft is None else CausalLM(draft.model, draft.tokenizer, name=draft.name, static_cache=False)
            return make_drafter(key.drafter, self._options_for(key.drafter), draft_model=own, target_model=self.target,
                                shared=self._shared, memory=memory, remember=self.remember)

        return make
