"""The `oracle` drafter, for benchmarks only: a synthetic drafter of known acceptance α.

It proposes the target's own future tokens, read from a recorded plain (`ar`) greedy run of
the same prompt (`record(prompt + output)`), and replaces each proposed token, independently,
by a wrong one with probability 1 − α. The verifier keeps a chain up to its first wrong token,
so a draft position is accepted with probability α given the ones before it were: the
per-token acceptance of `analysis.theory`, and E[committed per step] = (1 − α^(k+1)) / (1 − α).
On random weights (no real drafter agrees with them) this measures what the machinery makes of
a given α: the speedup next to the theory curve at that α.

- A wrong token is a different valid id: the true one minus 1 (1 for token 0), so it never
  equals the true token and needs no vocabulary size.
- The right/wrong draws come from the drafter's own `torch.Generator` on the CPU, seeded per
  request from `seed` and the prompt: a seed reproduces a run whatever ran before it, and the
  request's sampling generator is never touched.
- Proposals are point masses (`q_draft = None`) and greedy runs only: with sampling the target's
  own token is not a fixed sequence to read ahead from.
- No `scores`: the only estimate the oracle could honestly give, α^(i+1) at position i, is the
  same for every draft, so it tells the policy nothing its per-position counts do not (`AutoK`
  learns α from them; only tree drafters and `suffix` chains score their drafts).
- Once the committed sequence leaves the recording (a numerical near-tie in the target) or the
  recording ends, nothing is proposed and the step is plain decoding.

It is never something `generate` or `serve` offers: it needs a recording, which `specdraft
bench` makes before each timed run (`spec:drafter=oracle;oracle-alpha=0.8`, see `bench.methods`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.errors import SpecdraftError

DEFAULT_ALPHA = 0.8
DEFAULT_SEED = 0
NO_RECORDING = ("The oracle drafter is for benchmarks: it needs a recorded ar run of this prompt (`record(...)`); "
                "use it through `specdraft bench --methods spec:drafter=oracle;oracle-alpha=A`.")


class OracleDrafter(Drafter):
    """Bench only: proposes the recorded greedy continuation, each token wrong with probability 1 − `alpha`
    (module doc). `record(token_ids)` first, once per prompt; one drafter serves every recorded prompt."""

    name = "oracle"

    def __init__(self, alpha: float = DEFAULT_ALPHA, seed: int = DEFAULT_SEED) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha)
                                                                                 and 0.0 <= alpha <= 1.0):
            raise SpecdraftError(f"oracle-alpha (the chance each proposed token is right) must be a number in "
                                 f"[0, 1]; got {alpha!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise SpecdraftError(f"oracle-seed must be a whole number; got {seed!r}.")
        self.alpha, self.seed = float(alpha), seed
        self.generator = torch.Generator(device="cpu")  # the right/wrong draws; never the request's
        self.recordings: list[list[int]] = []  # each: prompt + ar output, most recent last
        self._recording: list[int] | None = None  # this request's
        self._recorded: torch.Tensor | None = None  # [N] int64 on the CPU: the same
        self._matched = 0  # leading tokens of the committed sequence known to agree with the recording
        self._on = False  # whether the committed sequence is still a prefix of the recording

    def record(self, token_ids: Sequence[int]) -> None:
        """Remember a plain greedy run of the target: its prompt followed by its output. A request whose
        prompt begins the recording reads ahead from it (the most recent such recording)."""
        tokens = [int(t) for t in token_ids]
        if not tokens or min(tokens) < 0:
            raise SpecdraftError("An oracle recording is a non-empty list of token ids (prompt + ar output), "
                                 "none negative.")
        self.recordings = [r for r in self.recordings if r != tokens] + [tokens]

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L]
        ids = prompt.tolist()
        self._recording = next((r for r in reversed(self.recordings) if r[: len(ids)] == ids and len(r) >= len(ids)),
                               None)
        self._recorded = None if self._recording is None else torch.tensor(self._recording, dtype=torch.long)  # [N]
        self._matched, self._on = len(ids), self._recording is not None
        digest = hashlib.sha256(repr((self.seed, ids)).encode()).digest()
        self.generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)  # one stream per (seed, prompt)

    def _check(self, ctx: DraftContext) -> None:
        if not ctx.params.greedy:
            raise SpecdraftError("The oracle drafter measures greedy runs only (its tokens come from a recorded "
                                 "greedy run); use temperature 0.")
        if self._recording is None:
            raise SpecdraftError(NO_RECORDING)

    def _position(self, ctx: DraftContext) -> int | None:
        """Where the committed sequence ends in the recording, or None once it has left it."""
        length = ctx.sequence.shape[0]
        if self._on and length > self._matched:  # read only the tokens committed since the last look
            if length > len(self._recording):
                self._on = False
            else:
                self._on = ctx.sequence[self._matched : length].tolist() == self._recording[self._matched : length]
            self._matched = length
        return length if self._on else None

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        self._check(ctx)
        position = self._position(ctx)
        if self.name in declined or position is None or position >= len(self._recording):
            return None
        return self.name

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        self._check(ctx)
        position = self._position(ctx)
        device = ctx.sequence.device
        if position is None or k < 1:
            return Draft.chain(ctx.sequence.new_empty(0))
        true = self._recorded[position : position + k]  # [n], n ≤ k: fewer where the recording ends
        right = torch.rand(true.shape[0], generator=self.generator) < self.alpha  # [n] bool
        wrong = torch.where(true > 0, true - 1, torch.ones_like(true))  # [n]: a valid id, never the true one
        return Draft.chain(torch.where(right, true, wrong).to(device))  # [n]
