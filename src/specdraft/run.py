"""One request's run: the checks a request passes, its state while it generates, and the events it emits.

Both drivers of the step (`engine.SpeculativeDecoder`, one request; `batch_engine.BatchedDecoder`, many) check a
request with `check_request` and start its state with `start_run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdraft.constraints import Constraint, GrammarState, start_grammar
from specdraft.drafters.base import Draft
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import SamplingParams
from specdraft.stats import GenerationStats
from specdraft.text import IncrementalText

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


def check_request(target: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int, logprobs: int | None,
                  stop: Sequence[str]) -> list[str]:
    """Refuse a request `target` cannot run (SpecdraftError naming what is wrong); its stop strings, empty ones
    dropped."""
    if not prompt_ids:
        raise SpecdraftError("The prompt is empty; give at least one token.")
    if len(prompt_ids) >= target.max_context:
        raise SpecdraftError(f"The prompt has {len(prompt_ids)} tokens, but {target.name} holds {target.max_context} "
                             "in all; shorten the prompt.")
    if min(prompt_ids) < 0 or max(prompt_ids) >= target.vocab_size:
        raise SpecdraftError(f"Prompt token ids must lie in [0, {target.vocab_size}); got one outside.")
    if max_new_tokens < 1:
        raise SpecdraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise SpecdraftError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}.")
    stops = [s for s in stop if s]
    if stops and target.tokenizer is None:
        raise SpecdraftError("Stop strings need a tokenizer to decode the output; this model has none.")
    return stops


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


def start_run(target: CausalLM, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
              stops: list[str], logprobs: int | None, constraint: Constraint | None,
              stats: GenerationStats | None = None) -> RunState:
    """The state of a checked request (`check_request`) about to read its prompt, its clock started; `stats`: where
    its statistics go (default: new ones)."""
    device = target.device
    grammar = start_grammar(constraint, target)
    sequence = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # [L]
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)  # [V]
        seen[sequence] = True
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    return RunState(sequence, seen, params, params.make_generator(device), max_new_tokens,
                    IncrementalText(target.tokenizer, stops), stats, time.perf_counter(), logprobs, grammar)
