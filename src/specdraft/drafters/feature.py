"""What the trained drafters (`medusa`, `eagle`, `eagle3`, `mtp`, `dflash`) share: they read the target's hidden
states and score tokens through a head over part of the vocabulary (the target's own LM head restricted to their
vocabulary, or the head's own: EAGLE-3's). `CatchUpDrafter` adds what those with a cache of the target's states
(`eagle`, `eagle3`, `mtp`, `dflash`) share: the states pending until the next draft catches up on them."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from specdraft.drafters.base import Draft, DraftContext, Drafter
from specdraft.drafters.dynamic_tree import ranking
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import SubsetHead, target_subset_head
from specdraft.models.quantize import int4_kernel_available, quantize_int4
from specdraft.sampling import sample


def head_distributions(logits: torch.Tensor, ctx: DraftContext) -> torch.Tensor:
    """[m, V] what each row's candidates are drawn from (sampling) or ranked by (greedy: the plain softmax)."""
    seen_rows = ctx.seen.unsqueeze(0).expand(logits.shape[0], -1) if ctx.seen is not None else None
    return ranking(logits, ctx.params, seen_rows)


class FeatureDrafter(Drafter):
    """A drafter trained on `target`'s hidden states (of size `hidden_size`), drafting tokens
    among `vocab_ids` through the target's LM head (or through its own `head`, which then sets the vocabulary); a
    chain stops once its estimated survival falls below `min_confidence`."""

    needs_features = True
    description = "drafter"  # how errors name it
    feature_layers: tuple[int, ...] | None = None  # the target layers whose input states it reads; None: the final

    def __init__(self, target: CausalLM, hidden_size: int, vocab_ids: torch.Tensor | None, min_confidence: float,
                 head: SubsetHead | None = None) -> None:
        if hidden_size != target.config.hidden_size:
            raise SpecdraftError(f"This {self.description} reads hidden states of size {hidden_size}; "
                                 f"{target.name}'s are {target.config.hidden_size}.")
        self.vocab_head = head if head is not None else target_subset_head(target, vocab_ids)
        self.features_width = hidden_size  # how wide the states it is handed are (`checked`)
        self.dtype = self.vocab_head.inner.weight.dtype  # what features are cast to (kept when the head goes int4)
        self.min_confidence = min_confidence
        self.target = target

    def claim_features(self) -> None:
        """Make the target's passes return the states this drafter reads (`CausalLM.read_features_at`): anew before
        each request's prompt pass (the engines call it, for a batch's siblings too), so drafters reading different
        states take turns on one target (the methods of one bench run, a server's requests one after another);
        drafting at once with both is refused (`checked`). `eagle3` and `dflash` also claim when made."""
        self.target.read_features_at(self, self.feature_layers)

    def checked(self, hidden: torch.Tensor) -> torch.Tensor:
        """The states handed to `features` (# [n, features_width]), checked: an `eagle3` drafter alive on the same
        target makes its passes return other states (`CausalLM.read_features_at`), which this drafter cannot read."""
        if hidden.shape[0] and hidden.shape[-1] != self.features_width:
            raise SpecdraftError(f"This {self.description} reads target states {self.features_width} wide and was "
                                 f"handed {hidden.shape[-1]}: another drafter on the same target (eagle3, dflash), "
                                 "drafting at the same time, asked its passes for other states. Run one kind of "
                                 "feature drafter per target at a time.")
        return hidden

    def sibling(self) -> "FeatureDrafter":
        """A drafter for another sequence (of a batch) over the same trained weights and vocabulary head: the
        weights are loaded and packed once, however many sequences draft with them. Its state is its own once
        `begin` sets it, which every request does first; a drafter that keeps state in its weights' module (a
        cache) makes that its own here."""
        return copy.copy(self)

    def draw_chain(self, ctx: DraftContext, depth: int,
                   row_logits: Callable[[int, torch.Tensor | None], torch.Tensor]) -> Draft:
        """A chain of up to `depth` tokens: token i is drawn from (greedy: the argmax of) the distribution of
        `row_logits(i, token i - 1)` (# [1, V]; None before the first), masked by a constraint after the tokens
        drawn before it. The chain stops after the token that takes the product of the drawn tokens' probabilities
        below `min_confidence`: whether a token is drawn never depends on its own value."""
        greedy = ctx.params.greedy
        drafted, rows = [], []
        survival, token = 1.0, None
        for i in range(depth):
            logits = row_logits(i, token)  # [1, V]
            if ctx.grammar is not None:  # masked after the tokens drafted so far
                logits = ctx.constrain(logits, [[int(t) for t in drafted]])
            probs = head_distributions(logits, ctx)  # [1, V]
            token = probs.argmax(-1) if greedy else sample(probs, ctx.generator)  # [1]
            drafted.append(token)
            rows.append(probs)
            if self.min_confidence:
                survival *= float(probs[0, token[0]])
                if survival < self.min_confidence:  # the next token is not drawn; this one stays
                    break
        return Draft.chain(torch.cat(drafted), None if greedy else torch.cat(rows))

    def run_in_int4(self, module: torch.nn.Module) -> None:
        """On the CPU, swap the linears of `module` (the trained weights) and of the vocabulary head for int4
        kernels, as `--draft-quant auto` does for a draft model: a bandwidth-bound draft token then reads a
        quarter of the bytes (the shipped EAGLE drafter in float32: 4.9 ms for its head, 2.5 ms for its layer).
        Drafts only propose differently; the output stays exact, q being what they were drawn from."""
        if self.vocab_head.ids.device.type == "cpu" and int4_kernel_available():
            quantize_int4(module)
            if not any(part is self.vocab_head for part in module.modules()):  # an EAGLE-3 head's is the module's
                quantize_int4(self.vocab_head)


class CatchUpDrafter(FeatureDrafter):
    """A feature drafter whose weights' module (`self.model`) caches the target's states: those handed over since
    the last draft wait in `_pending` until `propose` catches up on them; `_real` counts the cached positions built
    from the target's own states. A subclass calls `attach` once its vocabulary head is set."""

    def attach(self, model: torch.nn.Module) -> None:
        """Draft with `model` (the trained weights, in int4 where `run_in_int4` does so) and the target's input
        embeddings; nothing pending yet."""
        self.model = model
        self.run_in_int4(self.model)
        self.embed = self.target.model.get_input_embeddings()
        self._pending: list[torch.Tensor] = []  # [n, features_width] states not yet in the cache
        self._real = 0  # cache positions built from the target's own states

    def sibling(self) -> "CatchUpDrafter":
        twin = super().sibling()
        twin.model, twin._pending = self.model.with_own_cache(), []  # its cache and pending states its own
        return twin

    def begin(self, prompt: torch.Tensor) -> None:
        self.model.reset_cache(prompt.shape[0] + 256)
        self._pending, self._real = [], 0

    def features(self, hidden: torch.Tensor) -> None:  # hidden: [n, features_width]
        if self.checked(hidden).shape[0]:
            self._pending.append(hidden)

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        if not self._pending and self._real == 0:  # a one-token prompt: nothing to read yet
            return None
        return super().source(ctx, declined)

    def take_pending(self) -> torch.Tensor:
        """The states handed over since the last draft, in order (# [n, features_width]); none are pending after."""
        if not self._pending:  # the engine hands over features after every step, so this is a bug
            raise RuntimeError(f"{self.name} drafter: asked to propose with no new target features")
        fresh, self._pending = torch.cat(self._pending), []
        return fresh

    def check_made_for(self, target: CausalLM, hidden_size: int, vocab_size: int, made_for: str, advice: str) -> None:
        """Refuse a `target` of another width or vocabulary than the checkpoint's (`made_for`: what the checkpoint
        calls its target; `advice`: what to do instead)."""
        if vocab_size != target.vocab_size or hidden_size != target.config.hidden_size:
            raise SpecdraftError(f"This {self.description} was made for {made_for} {hidden_size} wide with "
                                 f"{vocab_size} tokens (its config.json); {target.name} is "
                                 f"{target.config.hidden_size} wide with {target.vocab_size}. {advice}")
