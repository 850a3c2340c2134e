"""One answer's place in its grammar: the mask of legal tokens after any draft prefix.

The matcher sits at the committed sequence plus `_ahead`, a draft prefix it has consumed; asking for another prefix
rolls back to the common part and consumes the rest (tokens are checked first: a matcher that consumed an illegal
token would be in an error state for good). An EOS token is never consumed: the answer ends there, so nothing after
it is masked, and whether the grammar allows it is read from the mask before it. Masks are kept for the step by
prefix, so the drafter's masks are the verifier's; `commit` moves to the committed tokens and forgets them.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Sequence

import torch

from specdraft.constraints.constraint import Constraint
from specdraft.errors import SpecdraftError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from specdraft.models.causal_lm import CausalLM

_BIT = torch.arange(32, dtype=torch.int32)  # [32]: a mask word's bits
_tokenizers: dict[tuple[int, int, tuple[int, ...]], tuple[object, "LLTokenizer"]] = {}
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(target: "CausalLM") -> "LLTokenizer":
    """llguidance's view of the target's tokenizer over its whole vocabulary (the logits' width), ending at any of
    its EOS tokens; built once per tokenizer (about 1 s for 151,936 tokens)."""
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise SpecdraftError(f"A constraint needs the model's tokenizer; {target.name} has none.")
    key = (id(tokenizer), target.vocab_size, tuple(sorted(target.eos_token_ids)))
    with _tokenizers_lock:
        if key not in _tokenizers:
            import llguidance.hf

            try:
                built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=target.vocab_size, eos_token=list(key[2]))
            except ValueError as error:  # a slow (Python) tokenizer
                raise SpecdraftError(f"A constraint needs a fast tokenizer: {error}.") from None
            _tokenizers[key] = (tokenizer, built)  # the tokenizer is held so its id stays its own
        return _tokenizers[key][1]


def check_constraint(constraint: Constraint, target: "CausalLM") -> str:
    """The constraint's llguidance grammar, checked against the target's tokenizer: a schema, regex or grammar
    llguidance cannot follow is a SpecdraftError naming what is wrong."""
    from llguidance import LLMatcher

    grammar = constraint.grammar_text()
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, grammar_tokenizer(target))
    if failed:
        raise SpecdraftError(f"The {constraint.label} is not valid: {messages[0].strip()}")
    return grammar


def start_grammar(constraint: Constraint | None, target: "CausalLM") -> "GrammarState | None":
    """A fresh state at the start of an answer under `constraint` (None: no constraint); a grammar llguidance cannot
    follow leaves its matcher in an error state, which is a SpecdraftError naming what is wrong."""
    if constraint is None:
        return None
    from llguidance import LLMatcher

    matcher = LLMatcher(grammar_tokenizer(target), constraint.grammar_text(), log_level=0)
    if matcher.is_error():
        raise SpecdraftError(f"The {constraint.label} is not valid: {matcher.get_error()}")
    return GrammarState(matcher, target.vocab_size, target.device, target.eos_token_ids)


class GrammarState:
    """Where one answer stands in its grammar (module doc). Not thread-safe: it belongs to one request."""

    def __init__(self, matcher: "LLMatcher", vocab: int, device: torch.device, eos_ids: set[int]) -> None:
        self._matcher = matcher
        self.vocab, self.device, self.eos_ids = vocab, device, set(eos_ids)
        self._ahead: list[int] = []  # draft tokens consumed past the committed sequence
        self._masks: dict[tuple[int, ...], torch.Tensor | None] = {}  # this step's, by prefix
        self._words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)  # [W] llguidance's bitmask
        self._everything = torch.ones(vocab, dtype=torch.bool, device=device)  # [V]: a row no accepted path reaches
        self.mask_seconds = 0.0  # spent computing masks (and moving the matcher to them)

    def _move(self, prefix: Sequence[int]) -> bool:
        """Put the matcher at the committed sequence + `prefix`; False (the matcher at its longest legal part before
        any EOS) when the grammar forbids a token of it or it holds an EOS (the answer ends there)."""
        ends = next((i for i, token in enumerate(prefix) if token in self.eos_ids), None)
        if ends is not None:
            return self._move(prefix[:ends]) and False
        same = 0
        while same < min(len(self._ahead), len(prefix)) and self._ahead[same] == prefix[same]:
            same += 1
        if len(self._ahead) > same:
            self._matcher.rollback(len(self._ahead) - same)
            del self._ahead[same:]
        rest = list(prefix[same:])
        if not rest:
            return True
        legal = self._matcher.validate_tokens(rest)
        if legal:
            self._matcher.consume_tokens(rest[:legal])
            self._ahead += rest[:legal]
        return legal == len(rest)

    def allowed(self, prefix: Sequence[int] = ()) -> torch.Tensor | None:
        """[V] bool: the tokens the grammar allows after the committed sequence + `prefix`; None where `prefix`
        itself is forbidden (a position no accepted path reaches) or nothing is allowed."""
        key = tuple(prefix)
        if key not in self._masks:
            started = time.perf_counter()
            mask = None
            if self._move(key) and not self._matcher.is_error():
                self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
                bits = (self._words.unsqueeze(-1) >> _BIT) & 1  # [W, 32]
                mask = bits.flatten()[: self.vocab].bool().to(self.device)  # [V]
                if not mask.any():
                    mask = None
            self._masks[key] = mask
            self.mask_seconds += time.perf_counter() - started
        return self._masks[key]

    def legal(self, prefix: Sequence[int]) -> bool:
        """Whether the grammar allows every token of `prefix` after the committed sequence."""
        if len(prefix) == 0:
            return True
        before = self.allowed(prefix[:-1])
        return before is not None and bool(before[prefix[-1]])

    def mask_rows(self, logits: torch.Tensor, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """`logits` [m, V] with -inf at the tokens the grammar forbids after each row's prefix (a row whose prefix is
        forbidden stays as it is: no accepted path reaches it). A row left with no finite logit (a draft head that
        scores only common tokens, where the grammar allows only others) becomes uniform over the allowed tokens:
        a drafter still proposes a legal token, from a q it can report."""
        masks = [self.allowed(prefix) for prefix in prefixes]
        if all(mask is None for mask in masks):
            return logits
        allowed = torch.stack([self._everything if mask is None else mask
                               for mask in masks])[:, : logits.shape[-1]]  # [m, V]
        masked = logits.masked_fill(~allowed, float("-inf"))
        dead = masked.amax(-1) == float("-inf")  # [m]
        if dead.any():
            masked[dead] = torch.zeros_like(masked[dead]).masked_fill(~allowed[dead], float("-inf"))
        return masked

    def forced(self, prefix: Sequence[int] = ()) -> int | None:
        """The one token the grammar allows after the committed sequence + `prefix`, or None (several, or none)."""
        mask = self.allowed(prefix)
        if mask is None or int(mask.sum()) != 1:
            return None
        return int(mask.int().argmax())

    def forced_run(self, prefix: Sequence[int] = (), limit: int = 1 << 30) -> list[int]:
        """The tokens the grammar alone decides, one after another, after the committed sequence + `prefix`: at most
        `limit`, ending with an EOS if the grammar forces one."""
        run: list[int] = []
        while len(run) < limit:
            token = self.forced(tuple(prefix) + tuple(run))
            if token is None:
                break
            run.append(token)
            if token in self.eos_ids:
                break
        return run

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence grew by `tokens` (each allowed in turn; an EOS, if any, last): they become the committed
        state."""
        if not self._move(tokens[:-1] if tokens and tokens[-1] in self.eos_ids else tokens):
            raise SpecdraftError("Internal error: a committed token breaks the constraint's grammar.")
        self._ahead = []
        self._masks.clear()

    @property
    def accepting(self) -> bool:
        """Whether the answer so far is complete under the grammar."""
        return self._matcher.is_accepting()
