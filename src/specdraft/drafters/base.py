"""What every drafter returns and the interface the engine calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator

import torch

from specdraft.sampling import SamplingParams
from specdraft.tree import TreeLayout

if TYPE_CHECKING:
    from specdraft.constraints import GrammarState


@dataclass
class Draft:
    """The proposal of one step.

    A chain is a tree whose parents are `i - 1` (the first token's parent, -1, is the last
    committed token); any other tree carries its compiled `layout`. `q_draft` is the distribution each token was actually drawn from, or
    `None` for a deterministic proposal (verified as a point mass). `scores`, where the drafter
    has them, are its own estimates that each token lies on the accepted path (path probabilities
    under the draft, the heads or the empirical counts), never rising from a token to its children.
    `drawn` counts the leading tokens drawn from their q rows; the rest are point masses (a sampled
    tree lists its drawn chain first, then its siblings). None: every token when `q_draft` is set.
    """

    tokens: torch.Tensor  # [k] int64
    parents: torch.Tensor  # [k] int64
    q_draft: torch.Tensor | None = None  # [k, V] float32
    layout: TreeLayout | None = None  # the tree's shape; None for a chain
    scores: list[float] | None = None  # [k]
    drawn: int | None = None  # leading tokens drawn from their q rows (see above)

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def drawn_count(self) -> int:
        """How many leading tokens were drawn from their q rows (the rest are point masses)."""
        return self.k if self.drawn is None and self.q_draft is not None else self.drawn or 0

    @property
    def must_keep(self) -> int:
        """How many leading tokens a cut must keep (at least 1): every drawn one. Cutting a drawn token by
        what was drawn would bias it away from its q; point masses may go by any rule of the drafter's."""
        return max(1, self.drawn_count)

    @staticmethod
    def tree(tokens: torch.Tensor, parents: list[int], q_draft: torch.Tensor | None = None,
             scores: list[float] | None = None, drawn: int | None = None) -> "Draft":
        """A tree draft (see `tree.TreeLayout`); a parent list that is a chain gives a chain draft."""
        layout = TreeLayout.from_parents(parents, tokens.device)
        if layout.is_chain:
            return Draft.chain(tokens, q_draft, scores, drawn)
        return Draft(tokens, torch.tensor(parents, dtype=torch.long, device=tokens.device), q_draft, layout=layout,
                     scores=scores, drawn=drawn)

    @staticmethod
    def chain(tokens: torch.Tensor, q_draft: torch.Tensor | None = None, scores: list[float] | None = None,
              drawn: int | None = None) -> "Draft":
        """A chain draft: token i's parent is token i - 1."""
        parents = torch.arange(-1, tokens.shape[0] - 1, device=tokens.device)
        return Draft(tokens=tokens, parents=parents, q_draft=q_draft, scores=scores, drawn=drawn)

    @property
    def is_chain(self) -> bool:
        """Whether every token's parent is the one before it (no `layout`)."""
        return self.layout is None

    @property
    def height(self) -> int:
        """How deep the draft goes: a chain's k, a tree's deepest token's depth."""
        return self.k if self.layout is None else self.layout.height

    def path(self, deepest: int) -> list[int]:
        """The tokens from the root's child down to `deepest` (-1, the root: none); a chain's first deepest + 1."""
        return list(range(deepest + 1)) if self.layout is None else self.layout.path(deepest)

    def is_bonus(self, deepest: int) -> bool:
        """Whether the target's token after an accepted path ending at `deepest` is a bonus (nothing below was
        drafted) rather than a recovery."""
        return deepest == self.k - 1 if self.layout is None else self.layout.is_leaf(deepest)

    def block_attention(self, prefix: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Offsets [T] and visibility [T, T] of a pass over `prefix` committed tokens then the draft
        (`TreeLayout.block_attention`); (None, None) for a chain: consecutive and causal."""
        return (None, None) if self.layout is None else self.layout.block_attention(prefix)

    def rows_ancestors(self) -> torch.Tensor | None:
        """[k + 1, k + 1] bool: the tokens each verification row's prefix holds (`TreeLayout.rows_ancestors`);
        None for a chain (row i holds the first i)."""
        return None if self.layout is None else self.layout.rows_ancestors()

    def prefix(self, n: int) -> "Draft":
        """The draft's first `n` tokens (a tree stays a tree: tokens are in topological order, so every kept
        token's parent is kept); token indices, and so paths, are unchanged."""
        return self if n >= self.k else self.select(list(range(n)))

    def paths(self) -> list[tuple[int, ...]]:
        """Each token's path from the committed sequence: its ancestors' tokens and its own (a chain: the first
        i + 1 tokens)."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens.tolist(), self.parents.tolist()):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        return paths

    def allowed_by(self, grammar: "GrammarState") -> "Draft":
        """The draft without the tokens `grammar` forbids on their path (and their descendants), except tokens drawn
        from a q: cutting by a drawn value would bias it; the verifier rejects those (p = 0 there)."""
        drawn = self.drawn_count
        keep = [i for i, path in enumerate(self.paths()) if i < drawn or grammar.legal(path)]
        return self if len(keep) == self.k else self.select(keep)

    def select(self, nodes: list[int]) -> "Draft":
        """The draft of the tokens at `nodes` (increasing, each token's parent among them), parents renumbered; the
        drawn tokens lead as before (a selection that drops one of them keeps only those before it as drawn)."""
        index = {node: i for i, node in enumerate(nodes)}
        parents = self.parents.tolist()
        new_parents = [index[parents[node]] if parents[node] >= 0 else -1 for node in nodes]
        rows = torch.tensor(nodes, dtype=torch.long, device=self.tokens.device)  # [n]
        q_draft = None if self.q_draft is None else self.q_draft[rows]
        scores = None if self.scores is None else [self.scores[node] for node in nodes]
        drawn = None
        if self.drawn is not None:
            drawn = next((i for i, node in enumerate(nodes) if node != i or i >= self.drawn), len(nodes))
        return Draft.tree(self.tokens[rows], new_parents, q_draft, scores, drawn)


@dataclass
class DraftContext:
    """What a drafter may read when it proposes: the committed sequence, how to sample, and the
    tree shape the engine allows (a drafter that cannot branch proposes a chain regardless)."""

    sequence: torch.Tensor  # [L] int64: prompt + committed tokens
    params: SamplingParams
    generator: torch.Generator
    seen: torch.Tensor | None  # [V] bool, tokens of `sequence` (only with a repetition penalty)
    tree_branch: int = 1  # children per node a tree drafter may propose; 1 = a chain
    max_depth: int | None = None  # the deepest a tree may go (None: as deep as the node budget k)
    grammar: "GrammarState | None" = None  # the answer's constraint, where it has one

    def constrain(self, logits: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
        """`logits` [m, V] with the constraint's mask after each row's draft prefix (tokens past the committed
        sequence) applied: what a drafter draws from or ranks by, like the target's rows. Unchanged without one."""
        return logits if self.grammar is None else self.grammar.mask_rows(logits, prefixes)


@dataclass
class DraftPass:
    """One pass a drafter asks of its model: `tokens` [1, T] after what `model`'s cache holds (a `CausalLM`, or a
    `packed_cache.CacheView`), `prompt` as `CausalLM.forward` takes it."""

    model: Any
    tokens: torch.Tensor
    prompt: bool = False


def run_passes(steps: Generator[DraftPass, torch.Tensor, Draft]) -> Draft:
    """Drive a drafter's `propose_steps` alone, each pass on its own model; the draft it returns."""
    try:
        request = next(steps)
        while True:
            logits = request.model.forward(request.tokens, logits_to_keep=1, prompt=request.prompt).logits[0]  # [1, V]
            request = steps.send(logits)
    except StopIteration as done:
        return done.value


class Drafter:
    """Proposes tokens for the target to verify.

    Call order per request: `begin(prompt)`; then per step `source(ctx)`, and when that is
    not None, `propose(ctx, k)` and `commit(prev_len, path)`; finally `end(sequence)`. A
    drafter that `needs_features` also gets `features(hidden)` after `begin` and every step.
    A drafter keeps whatever state it needs (a KV cache, an index) in step with the committed
    sequence (`ctx.sequence` only ever grows by committed tokens).
    """

    name: str = "base"
    needs_features: bool = False  # whether the engine hands it the target's final hidden states (`features`)

    @property
    def cache_bytes_per_token(self) -> int:
        """Bytes of the drafter's own cache per token of the sequence (a draft model's KV cache; 0: none)."""
        return 0

    def model_parts(self) -> list["Drafter"]:
        """The parts of this drafter that draft with a model and a cache of their own (`ModelDrafter`s, whose
        `model` a batch may swap for a view of a cache it packs: `packed_cache`)."""
        return []

    def begin(self, prompt: torch.Tensor) -> None:  # prompt: [L]
        """Start a new request with this prompt."""

    def claim_features(self) -> None:
        """Ask the target's passes for the states this drafter reads (a drafter that `needs_features`), before they run
        for a request: the engines call it ahead of the prompt's pass. Nothing for one that reads none."""

    def source(self, ctx: DraftContext, declined: frozenset[str] = frozenset()) -> str | None:
        """Who will propose this step (a name the policy keeps separate estimates for), or None
        when there is nothing worth proposing (the step is then plain decoding). `declined`
        names sources the policy has already turned down this step; the next `propose` comes
        from the source returned last."""
        return None if self.name in declined else self.name

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        """Up to `k` tokens continuing `ctx.sequence` (a tree drafter: up to `k` nodes)."""
        raise NotImplementedError

    def propose_steps(self, ctx: DraftContext, k: int) -> Generator[DraftPass, torch.Tensor, Draft]:
        """`propose` as a generator of the model passes it needs: it yields each `DraftPass`, is sent the logits
        after the pass's last token (# [1, V]), and returns the draft, so a batch can run the passes of many
        drafters together (`run_passes`). A drafter without model passes returns at once."""
        return self.propose(ctx, k)
        yield  # a generator all the same

    def unread(self, ctx: DraftContext) -> int:
        """Committed tokens the source returned last must read before it can draft (a draft model's
        catch-up: the prompt on its first draft, the tokens of plain steps after); the policy prices them."""
        return 0

    def features(self, hidden: torch.Tensor) -> None:  # hidden: [n, H]
        """The target's final hidden states at the next n positions of the sequence, in order and
        each once (only for a drafter that `needs_features`): after `begin`, those of the prompt
        but its last token; after every step, those of the tokens the target's pass kept (the
        last committed token before the step and the accepted path), before `commit`. The
        hidden state at position t is what the target's LM head turned into token t + 1."""

    def commit(self, prev_len: int, path: list[int]) -> None:
        """The sequence of length `prev_len` grew by the draft tokens at `path` (accepted, root
        to leaf; a chain: 0 .. a - 1) and one more token."""

    def end(self, sequence: torch.Tensor) -> None:  # sequence: [L] prompt + every committed token
        """The request is over (finished, or stopped early by its consumer)."""
