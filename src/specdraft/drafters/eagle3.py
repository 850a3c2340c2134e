"""The `eagle3` drafter: a published EAGLE-3 head (`models.eagle3`) drafting chains and dynamic trees.

The head reads the target's states entering three of its layers (low, middle, high), which the drafter asks the
target's passes for (`CausalLM.read_features_at`): prefill and every verification then hand over those, for the
kept rows, as they hand other feature drafters the final states (no extra target pass). Before drafting the
drafter catches up on the pairs (g_t = fc(features_t), x_{t+1}) it has not seen, in one pass whose last row
predicts the token after the last committed one; each draft token is then read off the layer's output h, which is
fed back with the token for the next one.

The head scores its draft vocabulary only; its logits come widened to the target's vocabulary with -inf off it
(`draft_head.SubsetHead`, draft id j -> target id j + d2t[j]), so q = 0 outside the draft vocabulary and the
verifier's min(1, p/q) and residual max(p - q, 0) stay exact: a target token the head cannot propose is still
reached through the residual.

After the verdict the layer's cache is cut back to the pairs built from the target's own features; the accepted
tokens return as real pairs at the next catch-up.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DraftContext
from specdraft.drafters.dynamic_tree import grow_dynamic_tree
from specdraft.drafters.feature import FeatureDrafter, head_distributions
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.eagle3 import Eagle3Model
from specdraft.sampling import sample


class Eagle3Drafter(FeatureDrafter):
    """Draft with a published EAGLE-3 head for `target` (see the module doc)."""

    name = "eagle3"
    description = "EAGLE-3 head"

    def __init__(self, target: CausalLM, model: Eagle3Model, min_confidence: float = 0.0) -> None:
        config = model.config
        if config.vocab_size != target.vocab_size:
            raise SpecdraftError(f"This EAGLE-3 head was made for a vocabulary of {config.vocab_size} tokens "
                                 f"(vocab_size in its config); {target.name}'s logits have {target.vocab_size}. "
                                 "Use the head published for this target.")
        if model.embed_tokens is None and config.hidden_size != target.config.hidden_size:
            raise SpecdraftError(f"This EAGLE-3 head is {config.hidden_size} wide and has no embed_tokens of its "
                                 f"own; {target.name}'s embeddings are {target.config.hidden_size} wide.")
        super().__init__(target, config.target_hidden_size, None, min_confidence, head=model.lm_head)
        self.layers = config.resolved_aux_layers(target.config.num_hidden_layers)
        self.features_width = len(self.layers) * config.target_hidden_size  # the layers' states side by side
        self.target, self.model = target, model
        self.run_in_int4(self.model)
        self.embed = target.model.get_input_embeddings()
        self._pending: list[torch.Tensor] = []  # [n, num_aux * H_target] features not yet in the layer's cache
        self._real = 0  # cache rows built from the target's own features
        target.read_features_at(self, self.layers)

    def sibling(self) -> "Eagle3Drafter":
        twin = super().sibling()
        twin.model, twin._pending = self.model.with_own_cache(), []  # its cache and pending features its own
        self.target.read_features_at(twin, self.layers)
        return twin

    def begin(self, prompt: torch.Tensor) -> None:
        self.model.reset_cache(prompt.shape[0] + 256)
        self._pending, self._real = [], 0

    def features(self, hidden: torch.Tensor) -> None:  # hidden: [n, num_aux * H_target]
        if self.checked(hidden).shape[0]:
            self._pending.append(hidden)

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        if not self._pending and self._real == 0:  # a one-token prompt: nothing to read yet
            return None
        return super().source(ctx, declined)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: [n] -> [n, H]
        return self.model.embed(tokens, self.embed).to(self.dtype)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        model, sequence = self.model, ctx.sequence
        if not self._pending:  # the engine hands over features after every step, so this is a bug
            raise RuntimeError("eagle3 drafter: asked to propose with no new target features")
        # Catch up: pairs (fc(f_t), x_{t+1}) for every feature that arrived since the last draft.
        model.truncate(self._real)
        fresh, self._pending = torch.cat(self._pending), []  # [n, num_aux * H_target]
        start = self._real
        tokens = sequence[start + 1:start + 1 + fresh.shape[0]]  # [n]
        positions = torch.arange(start, start + fresh.shape[0], device=tokens.device)  # [n]
        out = model(model.project(fresh.to(self.dtype)), self._embed(tokens), positions)[-1:]  # [1, H]
        self._real = start + fresh.shape[0]
        if ctx.tree_branch > 1:
            return self._tree(ctx, k, out)
        greedy = ctx.params.greedy
        drafted, rows = [], []
        survival = 1.0
        depth = min(k, ctx.max_depth or k)
        for i in range(depth):
            logits = model.draft_logits(out)  # [1, V]: -inf off the draft vocabulary
            if ctx.grammar is not None:  # masked after the tokens drafted so far
                logits = ctx.constrain(logits, [[int(t) for t in drafted]])
            probs = head_distributions(logits, ctx)  # [1, V]
            token = probs.argmax(-1) if greedy else sample(probs, ctx.generator)  # [1]
            drafted.append(token)
            rows.append(probs)
            if self.min_confidence:
                survival *= float(probs[0, token[0]])
                if survival < self.min_confidence:
                    break
            if i < depth - 1:
                position = torch.full((1,), self._real + i, device=token.device)
                out = model(model.fed_back(out), self._embed(token), position)  # [1, H]
        return Draft.chain(torch.cat(drafted), None if greedy else torch.cat(rows))

    def _tree(self, ctx: DraftContext, budget: int, root_out: torch.Tensor) -> Draft:
        """A dynamic tree (see `dynamic_tree`): each level's nodes are fed, with what their parents' outputs feed
        back, in one pass. # root_out: [1, H]"""
        model = self.model
        after: dict[int, torch.Tensor] = {}  # pool index -> what the next position reads after it  [H]
        root = model.fed_back(root_out)[0]  # [H]
        start = self._real  # position of the pairs of depth-1 tokens

        def expand(frontier: list[int], block: torch.Tensor, depth: int, visible: torch.Tensor,
                   parents: list[int]) -> torch.Tensor:
            inputs = torch.stack([root if parents[node] < 0 else after[parents[node]] for node in frontier])  # [m, H]
            positions = torch.full((len(frontier),), start + depth - 1, device=block.device)  # [m]
            out = model(inputs, self._embed(block[0]), positions, visible=visible)  # [m, H]
            after.update(zip(frontier, model.fed_back(out)))
            return model.draft_logits(out)  # [m, V]

        return grow_dynamic_tree(model.draft_logits(root_out), expand, ctx, budget, self.min_confidence).draft

    def commit(self, prev_len: int, path: list[int]) -> None:
        self.model.truncate(self._real)  # drafted rows go; the accepted tokens return as real pairs
