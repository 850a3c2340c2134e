"""Prompts read before, kept so that a prompt beginning like one of them reads only the rest (prefix caching).

Chat prompts share their beginnings: the template's system prompt, a few-shot preamble, a conversation's earlier
turns. `PrefixCache` keeps the cached rows (every layer's keys and values) of the prompts read last, up to a byte
budget, the least recently used leaving first. A prompt takes the rows of the longest prefix it shares with any kept
prompt and reads on from there: a batch's joining prompt (`batch_engine`), or a single request's
(`SpeculativeDecoder(prefixes=)`). Each prompt is kept under a salt (vLLM's `cache_salt`; "" by default) and shares
its rows only with prompts of the same salt: tenants of one server neither reuse nor learn (from
`cached_tokens`, or the time to the first token) what the others sent.

It is exact where the target `reads_split_exactly`: every token is computed alone there, so a prefix's rows are the
same bits however the prompt around them was read, and reading the rest after them gives the bits of one read
(tested). Elsewhere (a GPU's static cache, float32 or unpacked weights, AMX) a batch keeps none and a decoder refuses
one. Only rows that a prompt read wrote are kept, never a generated token's: on AMX a decoding step computes other
bits than a read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

Rows = list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer: keys, values [1, kv_heads, n, d]; None: no rows


@dataclass
class _Entry:
    tokens: torch.Tensor  # [n] int64: the prompt tokens whose rows these are
    rows: Rows
    nbytes: int
    salt: str = ""  # only prompts of the same salt share these rows


def shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens `a` and `b` ([n], [m] int64) have in common."""
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return n if differ.numel() == 0 else int(differ[0, 0])


class PrefixCache:
    """The rows of recently read prompts, at most `max_bytes` of them (module doc)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # the engine thread matches and adds; a server's route may clear
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self.nbytes = 0
        self.reused_tokens = 0  # prompt tokens taken from here instead of read

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: torch.Tensor, salt: str = "") -> tuple[int, Rows]:
        """The longest prefix of `tokens` ([n] int64) that a prompt kept under `salt` begins with: its length and its
        rows (views of the kept ones; (0, []) when none shares a token)."""
        with self._lock:
            best, best_key = 0, None
            for key, entry in self._entries.items():
                if entry.salt != salt:
                    continue
                length = shared_length(entry.tokens, tokens)
                if length > best:
                    best, best_key = length, key
            if best_key is None:
                return 0, []
            self._entries.move_to_end(best_key)
            self.reused_tokens += best
            rows = self._entries[best_key].rows
        return best, [None if layer is None else (layer[0][..., :best, :], layer[1][..., :best, :]) for layer in rows]

    def resume(self, lm, tokens: torch.Tensor, salt: str = "") -> int:
        """Put the rows of the longest beginning of prompt `tokens` ([n] int64) kept under `salt` into `lm`'s empty
        cache (a `CausalLM`'s); returns how many tokens they hold, where its read goes on."""
        reused, rows = self.match(tokens, salt)
        lm.append_rows(rows)
        return reused

    def keep(self, lm, tokens: torch.Tensor, salt: str = "") -> None:
        """Keep the rows `lm`'s cache holds for prompt `tokens` ([n] int64, its first n cached tokens) under `salt`."""
        self.add(tokens, lm.rows(tokens.shape[0]), salt)

    def add(self, tokens: torch.Tensor, rows: Rows, salt: str = "") -> None:
        """Keep a copy of `rows`, the cached rows of prompt `tokens` ([n] int64), under `salt`, unless a prompt kept
        under it already begins with them; prompts kept under it that `tokens` begin with leave (these rows hold
        theirs). The least recently used leave while the budget is exceeded; rows larger than the whole budget are
        not kept."""
        count = tokens.shape[0]
        nbytes = sum(2 * layer[0][..., :count, :].nbytes for layer in rows if layer is not None)
        if count == 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.salt != salt:
                    continue
                shared = shared_length(entry.tokens, tokens)
                if shared == count:  # a kept prompt begins with these tokens: it holds their rows already
                    self._entries.move_to_end(key)
                    return
                if shared == entry.tokens.shape[0]:
                    self._drop(key)
            while self._entries and self.nbytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            copied = [None if layer is None else (layer[0][..., :count, :].clone(), layer[1][..., :count, :].clone())
                      for layer in rows]
            self._entries[self._next_key] = _Entry(tokens.clone(), copied, nbytes, salt)
            self._next_key += 1
            self.nbytes += nbytes

    def clear(self) -> None:
        """Forget every kept prompt (from any thread)."""
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
