"""One KV cache over a model's weights, shared by many sequences: a batch's draft models in one pass a step.

A batch whose sequences each draft with a model over the same weights would run one draft pass per sequence and
token. `PackedCache` holds all their rows in one `CausalLM` cache, each row tagged with its owner, so the draft
tokens of every sequence at one depth go through the model in one pass (`run`); `CacheView` gives each owner the
cache interface a `ModelDrafter` uses (`cache_len`, `max_context`, `reset`, `truncate`, `forward`), so a drafter
runs over it unchanged, alone or together with others.

An owner's rows sit at its own positions 0, 1, .. in the order it wrote them, wherever they lie in the packed
cache; a token sees its owner's live rows and the earlier tokens of its own feed, nothing else. An owner's first
feed (a draft's first read of the prompt) is read alone, into a cache of its own whose rows are then appended, as
the batch reads a joining prompt: the states it gets alone, bit for bit, without a mask over others' rows. Rows cut back
(`truncate`, `reset`) turn invisible at once and leave the cache at the next `compact`, one pass over it for
all owners (the batch calls it once a step).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM, ForwardOutput

DEAD = -1  # the owner of a row cut back and not yet compacted away


def packed_visibility(row_owner: list[int], owners: list[int], blocks: list[int],
                      device: torch.device) -> torch.Tensor:
    """[T, N + T] bool for a pass over a packed cache of N rows (`row_owner`, DEAD matching no one): token j, of
    owner owners[j] and feed blocks[j], sees its owner's rows and the earlier tokens of its own feed."""
    rows = torch.tensor(row_owner, dtype=torch.long, device=device)  # [N]
    mine = torch.tensor(owners, dtype=torch.long, device=device)  # [T]
    block = torch.tensor(blocks, dtype=torch.long, device=device)  # [T]
    index = torch.arange(len(owners), device=device)  # [T]
    in_block = (block[:, None] == block[None, :]) & (index[None, :] <= index[:, None])  # [T, T]
    return torch.cat([mine[:, None] == rows[None, :], in_block], dim=1)


class PackedCache:
    """The rows of many owners in `lm`'s one cache (module doc)."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.row_owner: list[int] = []  # [lm.cache_len]: the owner of each row, DEAD once cut back
        self._rows: dict[int, list[int]] = {}  # owner -> where its live rows lie in the cache, in the order written
        self._reader = CausalLM(lm.model, lm.tokenizer, name=lm.name, static_cache=lm.static, warm=False)  # first reads
        lm.reset()

    def view(self, owner: int) -> "CacheView":
        """Owner `owner`'s cache (empty at first)."""
        self._rows.setdefault(owner, [])
        return CacheView(self, owner)

    def live(self, owner: int) -> int:
        """How many rows `owner` holds: the position its next token takes."""
        return len(self._rows.get(owner, ()))

    def cut(self, owner: int, length: int) -> None:
        """Keep `owner`'s first `length` rows; the rest turn invisible now and leave at the next `compact`."""
        self.keep(owner, length, [])

    def release(self, owner: int) -> None:
        """`owner` is gone: its rows leave at the next `compact`."""
        self.cut(owner, 0)
        self._rows.pop(owner, None)

    @property
    def owners(self) -> int:
        """How many owners hold a view."""
        return len(self._rows)

    def compact(self) -> None:
        """Drop the rows cut back since the last call, in one pass over the cache."""
        if DEAD not in self.row_owner:
            return
        start = self.row_owner.index(DEAD)
        kept = [row - start for row in range(start, len(self.row_owner)) if self.row_owner[row] != DEAD]
        self.lm.keep(start, kept)
        self.row_owner = [who for who in self.row_owner if who != DEAD]
        for rows in self._rows.values():
            rows.clear()
        for row, who in enumerate(self.row_owner):
            self._rows[who].append(row)

    def _append(self, owner: int, count: int) -> None:
        """`count` rows of `owner` were written at the end of the cache."""
        start = len(self.row_owner)
        self.row_owner += [owner] * count
        self._rows.setdefault(owner, []).extend(range(start, start + count))

    def run(self, feeds: list[tuple[int, torch.Tensor]], prompt: bool = False) -> list[torch.Tensor]:
        """One pass over every feed (owner, tokens [T_i]), each at its owner's next positions: the logits after
        each feed's last token, in order. # each [1, V]"""
        owners = [owner for owner, _ in feeds]
        if len(set(owners)) != len(owners):
            raise SpecdraftError("A packed pass takes each owner's tokens once.")
        if len(feeds) == 1 and not self.live(owners[0]):
            return [self._first_read(*feeds[0], prompt)]
        device = self.lm.device
        tokens = torch.cat([feed for _, feed in feeds])  # [T]
        positions = torch.cat([self.live(owner) + torch.arange(feed.shape[0], device=device)
                               for owner, feed in feeds])  # [T]
        visible = packed_visibility(self.row_owner, [owner for owner, feed in feeds for _ in range(feed.shape[0])],
                                    [i for i, (_, feed) in enumerate(feeds) for _ in range(feed.shape[0])], device)
        # only the logits of each feed's last token are used; a feed of one token (a draft step) wastes none
        ends = torch.cumsum(torch.tensor([feed.shape[0] for _, feed in feeds]), 0) - 1  # [B]
        keep = tokens.shape[0] - int(ends[0])
        reach = max(self.live(owner) + feed.shape[0] for owner, feed in feeds)
        with self._undone_on_failure():
            logits = self.lm.forward(tokens.unsqueeze(0), keep, offsets=positions - self.lm.cache_len,
                                     visible=visible, prompt=prompt, reach=reach).logits[0]  # [keep, V]
        for owner, feed in feeds:
            self._append(owner, feed.shape[0])
        first = tokens.shape[0] - keep
        return [logits[int(end) - first : int(end) - first + 1] for end in ends]

    def run_tree(self, owner: int, tokens: torch.Tensor, offsets: torch.Tensor, visible: torch.Tensor,
                 logits_to_keep: int) -> torch.Tensor:
        """One tree pass of `owner`'s tokens [T] alone, as `CausalLM.forward(offsets=, visible=)` runs it over a
        cache of its own: `offsets` [T] from the owner's next position, `visible` [T, S] over the owner's last S
        keys (its last S - T rows, then the tokens), every earlier row of its own seen, no other owner's. The
        logits of the last `logits_to_keep` tokens. # [logits_to_keep, V]"""
        device, held = self.lm.device, self._rows.get(owner, [])
        count, width = tokens.shape[0], visible.shape[1]
        if not count <= width <= len(held) + count:
            raise SpecdraftError(f"A tree pass of {count} tokens sees {width} keys; the owner holds {len(held)}.")
        allowed = torch.zeros(count, len(self.row_owner) + count, dtype=torch.bool, device=device)  # [T, N + T]
        older = width - count  # the owner's rows the mask speaks of; those before are all seen
        columns = torch.tensor(held, dtype=torch.long, device=device)  # [live]
        allowed[:, columns[: len(held) - older]] = True
        allowed[:, columns[len(held) - older :]] = visible[:, :older].to(device)
        allowed[:, len(self.row_owner) :] = visible[:, older:].to(device)
        positions = len(held) + offsets  # [T]
        # its furthest position; on a static (GPU) cache the width bounds the depths without a device sync
        reach = len(held) + (count if self.lm.static else int(offsets.max()) + 1)
        with self._undone_on_failure():
            logits = self.lm.forward(tokens.unsqueeze(0), logits_to_keep, offsets=positions - self.lm.cache_len,
                                     visible=allowed, reach=reach).logits[0]  # [logits_to_keep, V]
        self._append(owner, count)
        return logits

    @contextmanager
    def _undone_on_failure(self) -> Iterator[None]:
        """Write into `lm`: should the pass (or append) raise, the rows it wrote, some layers' or all, leave again,
        so the cache holds exactly the rows `row_owner` names and the other owners draft on as before."""
        try:
            yield
        except BaseException:
            self.lm.truncate(len(self.row_owner))
            raise

    def keep(self, owner: int, start: int, rows: list[int]) -> None:
        """Keep `owner`'s first `start` rows and those at `start + r` for r in `rows` (increasing); the others turn
        invisible now and leave at the next `compact`."""
        held = self._rows.get(owner, [])
        after = [held[start + r] for r in rows]
        for row in set(held[start:]) - set(after):
            self.row_owner[row] = DEAD
        held[start:] = after


    def _first_read(self, owner: int, tokens: torch.Tensor, prompt: bool) -> torch.Tensor:  # tokens: [T]
        """An owner's first feed, read alone into a cache of its own and appended: what it computes alone, bit for
        bit, and no attention over the other owners' rows. The logits after its last token. # [1, V]"""
        reader = self._reader
        try:
            logits = reader.forward(tokens.unsqueeze(0), logits_to_keep=1, prompt=prompt).logits[0]
            with self._undone_on_failure():
                self.lm.append_cache(reader)
        finally:
            reader.reset()
        self._append(owner, tokens.shape[0])
        return logits


class CacheView:
    """One owner's part of a `PackedCache`, with the cache interface of a `CausalLM` that a `ModelDrafter` uses."""

    def __init__(self, packed: PackedCache, owner: int) -> None:
        self.packed, self.owner = packed, owner

    @property
    def cache_len(self) -> int:
        return self.packed.live(self.owner)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.packed.lm.kv_bytes_per_token

    @property
    def max_context(self) -> int:
        """The positions an owner's rows may take: the model's context."""
        return self.packed.lm.max_context

    def reset(self) -> None:
        self.packed.cut(self.owner, 0)

    def truncate(self, length: int) -> None:
        self.packed.cut(self.owner, length)

    def forward(self, tokens: torch.Tensor, logits_to_keep: int = 1, prompt: bool = False,
                offsets: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> ForwardOutput:
        """This owner's tokens [1, T] alone through the packed cache: logits [1, 1, V] after the last
        (`PackedCache.run`), or with `offsets` and `visible` a tree pass as `CausalLM.forward` runs it
        (`PackedCache.run_tree`): logits [1, logits_to_keep, V]."""
        if offsets is not None or visible is not None:
            return ForwardOutput(logits=self.packed.run_tree(self.owner, tokens[0], offsets, visible,
                                                             logits_to_keep).unsqueeze(0))
        if logits_to_keep != 1:
            raise SpecdraftError("A packed draft cache returns the logits after a chain's last token only.")
        return ForwardOutput(logits=self.packed.run([(self.owner, tokens[0])], prompt)[0].unsqueeze(0))

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep this owner's first `start` rows and, after them, those it fed at `start + r` for each r in `rows`
        (increasing): `CausalLM.keep`, for what a tree pass leaves."""
        self.packed.keep(self.owner, start, rows)
