"""The server's decoders: one per (drafter, k, memory partition), built on first use over the loaded target and
draft, the least recently used dropped past a bound."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from specdraft.drafters import (DEFAULT_DRAFTER, DRAFTERS, Drafter, check_not_bench_only, drafter_options, make_drafter,
                                needs_draft_model, remembers_requests)
from specdraft.engine import DEFAULT_K, DEFAULT_TREE_BRANCH, SpeculativeDecoder, build_decoder, check_tree_options
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.policy import AUTO, GPU_MAX_AUTO_K, FixedK, make_policy
from specdraft.prefix_cache import PrefixCache

# The drafter name that asks for plain autoregressive decoding (no draft).
PLAIN = "none"
# Decoders kept at once (each holds its drafter's state, a `suffix` corpus up to ~100 MB); the least recently used
# leaves, so requests with ever new k or cache salts cannot pile them up.
DEFAULT_MAX_DECODERS = 8


@dataclass(frozen=True)
class DecoderKey:
    """Which decoder a request runs on: a drafter name (`none` = plain decoding), k (an integer or `auto`) and, for a
    drafter that learns from earlier requests, the partition of that memory it reads and adds to (its cache salt;
    "" for the others)."""

    drafter: str
    k: int | str
    cache_salt: str = ""


class DecoderPool:
    """The loaded target (and draft, if any) with the server's speculation defaults.

    `resolve` checks a request's speculation settings without touching the models (any thread);
    `decoder` builds or reuses the decoder for them, and must run on the engine thread only. `max_k`: the largest
    fixed k a request may ask for (the server checks it: `prepare`; by default what one pass can use: on a GPU a pass
    over 33 tokens costs about what one token's does, `GPU_MAX_AUTO_K`; past it a step scores [k + 1, V] logits in
    vain); at most `max_decoders` decoders are kept.
    """

    def __init__(self, target: CausalLM, draft: CausalLM | None = None, drafter: str = DEFAULT_DRAFTER,
                 k: int | str = DEFAULT_K, options: dict[str, Any] | None = None, tree_budget: int = 0,
                 tree_branch: int = DEFAULT_TREE_BRANCH, max_k: int = GPU_MAX_AUTO_K,
                 max_decoders: int = DEFAULT_MAX_DECODERS) -> None:
        check_tree_options(tree_budget, tree_branch)
        if max_k < 1 or max_decoders < 1:
            raise SpecdraftError(f"max_k and max_decoders must be >= 1, got {max_k} and {max_decoders}.")
        self.target, self.draft = target, draft
        self.options = {key: value for key, value in (options or {}).items() if value is not None}
        self.tree_budget, self.tree_branch = tree_budget, tree_branch
        self.max_k, self.max_decoders = max_k, max_decoders
        # whether drafters that learn from earlier requests may (False: `serve --cross-request-memory off`)
        self.remember = True
        self.default = self.resolve(drafter, k)
        self._decoders: OrderedDict[DecoderKey, SpeculativeDecoder] = OrderedDict()  # least recently used first
        # trained drafters' weights, loaded once for every decoder and a batch's sequences (`make_drafter`)
        self._shared: dict = {}
        self.prefixes: PrefixCache | None = None  # prompts read before, shared by the decoders (`keep_prefixes`)

    def keep_prefixes(self, max_bytes: int) -> None:
        """Let the decoders built from now on share a prefix cache of `max_bytes` (0: none), where the target reads
        prompts in splits exactly (elsewhere none is kept)."""
        self.prefixes = PrefixCache(max_bytes) if max_bytes and self.target.reads_split_exactly else None

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

    def _make_drafter(self, name: str, draft_model: CausalLM | None) -> Drafter:
        """Drafter `name` with the server's options, over the trained weights loaded once (`_shared`)."""
        return make_drafter(name, self._options_for(name), draft_model=draft_model, target_model=self.target,
                            shared=self._shared, remember=self.remember)

    def _options_for(self, drafter: str) -> dict[str, Any]:
        """The server's drafter options that `drafter` takes (they serve several drafters)."""
        known = drafter_options(drafter)
        return {name: value for name, value in self.options.items() if name in known}

    def drafter_factory(self, key: DecoderKey) -> Callable[[], Drafter] | None:
        """What makes a fresh drafter for one sequence of a batch under `key` (None: plain decoding); a draft
        model gets a cache of its own over the loaded weights each time, a trained drafter a state of its own over
        weights loaded once (`make_drafter`'s `shared`; engine thread only)."""
        if key.drafter == PLAIN:
            return None
        draft = self.draft

        def make() -> Drafter:
            # its cache is never filled: the batch packs every sequence's draft rows into one (`batch_engine`)
            own = None if draft is None else CausalLM(draft.model, draft.tokenizer, name=draft.name, static_cache=False)
            return self._make_drafter(key.drafter, own)

        return make

    def decoder(self, key: DecoderKey) -> SpeculativeDecoder:
        """The decoder for `key`, built on first use and kept while it is among the `max_decoders` used last
        (engine thread only: drafters hold model state); trained weights are loaded once for all of them."""
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            drafter = None if key.drafter == PLAIN else self._make_drafter(key.drafter, self.draft)
            decoder = build_decoder(self.target, drafter, k=key.k, tree_budget=self.tree_budget,
                                    tree_branch=self.tree_branch, prefixes=self.prefixes)
        self._decoders[key] = decoder
        while len(self._decoders) > self.max_decoders:
            self._decoders.popitem(last=False)
        return decoder
