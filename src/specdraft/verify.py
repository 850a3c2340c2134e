"""Chain and tree verification: keep exactly what the target would have produced.

Glossary (docs/design.md):
    accepted   draft tokens the verifier kept (a prefix of the draft)
    recovered  at the first rejection, a token drawn from normalize(max(p - q, 0))
    bonus      after a fully accepted draft, one more token drawn from the target's last row
    committed  accepted + (recovered or bonus): what one step appends

Greedy: a draft token is accepted when it equals the target's argmax at its position; the
first mismatch is replaced by that argmax (the recovered token), or after full acceptance
the argmax of the last row is the bonus.

Sampling (Leviathan et al. 2022; Chen et al. 2023): draft token x_i, drawn from q_i, is
accepted with probability min(1, p_i(x_i) / q_i(x_i)). A deterministic proposal
(`q_draft is None`) is a point mass: accepted with probability p_i(x_i), and the residual is
p_i with x_i removed. Everything is batched over a leading dimension B; the first rejection
is found with `cumprod`, so the whole verdict costs one host sync when read.

Worked example (k = 3): accepted mask [1, 0, 1] -> cumprod [1, 0, 0] -> num_accepted 1;
next token = candidates[1], the recovered token of position 1; committed = [x_0, r_1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from specdraft.sampling import sample
from specdraft.tree import TreeLayout

if TYPE_CHECKING:
    from specdraft.drafters.base import Draft


@dataclass
class Verdict:
    """What one verification decided, per batch row (a tree: one row)."""

    num_accepted: torch.Tensor  # [B] int64, in 0..k: the accepted prefix (a tree: the accepted path's depth)
    next_token: torch.Tensor  # [B] int64: the recovered token, or the bonus after a full prefix (below a leaf)
    last_node: torch.Tensor | None = None  # [B] int64: the deepest accepted draft token, -1 for none (the root)

    def deepest(self) -> torch.Tensor:
        """The deepest accepted draft token's index, -1 for none. # [B]"""
        return self.num_accepted - 1 if self.last_node is None else self.last_node


def verify(draft: "Draft", p_target: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """The one entry point: keep what the target would have produced of `draft` (`drafters.base.Draft`: a chain,
    or a tree with its layout), given the target's rows `p_target` [k + 1, V] (row 0 after the last committed
    token, then one per draft token; greedy: logits do). `generator` None: greedy. A chain is the tree whose
    parents are i - 1, verified by its own faster path. Returns a verdict over one row."""
    tokens = draft.tokens  # [k]
    if not draft.is_chain:
        return verify_tree(tokens, draft.layout, p_target, draft.q_draft, generator)
    if generator is None:
        return verify_greedy(tokens.unsqueeze(0), p_target.unsqueeze(0))
    q = None if draft.q_draft is None else draft.q_draft.unsqueeze(0)
    return verify_sampled(tokens.unsqueeze(0), q, p_target.unsqueeze(0), generator)


def residual_distribution(
    p: torch.Tensor,  # [B, k, V] target probabilities at the draft positions (any leading shape)
    q: torch.Tensor | None,  # [B, k, V] draft probabilities, or None for deterministic proposals
    draft_tokens: torch.Tensor,  # [B, k]
) -> torch.Tensor:
    """normalize(max(p - q, 0)) per row: `[B, k, V]`; falls back to p where the residual is empty.

    The residual is empty only where p == q up to rounding; rejection is then (nearly)
    impossible, and p is the right distribution to draw from.
    """
    if q is None:  # point mass on the draft token: p with that token removed
        residual = p.scatter(-1, draft_tokens.unsqueeze(-1), 0.0)
    else:
        residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)  # [B, k, 1]
    empty = mass <= 1e-12
    return torch.where(empty, p, residual / torch.where(empty, 1.0, mass))


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, k]
    p_target: torch.Tensor,  # [B, k + 1, V] (or logits: only the argmax is used)
) -> Verdict:
    """Accept the longest draft prefix equal to the target's argmax; then its argmax comes next."""
    return greedy_verdict(draft_tokens, p_target.argmax(-1))


def verify_greedy_chains(
    drafts: list[torch.Tensor],  # B chains, each [k_b]
    choices: list[torch.Tensor],  # each [k_b + 1]: the target's argmax after the last committed token, then each draft's
) -> Verdict:
    """`verify_greedy` of B chains of any lengths at once (a batch's sequences), a verdict of B rows to read in one
    host sync. Padded to the longest: [a1, a2] and [b1] -> [[a1, a2], [b1, -1]]; -1 matches no argmax, so chain b
    accepts at most its own k_b, and its next token is read from its own rows."""
    if len(drafts) == 1:
        return greedy_verdict(drafts[0].unsqueeze(0), choices[0].unsqueeze(0))
    tokens = pad_sequence(drafts, batch_first=True, padding_value=-1)  # [B, K]
    return greedy_verdict(tokens, pad_sequence(choices, batch_first=True))  # choices: [B, K + 1]


def greedy_verdict(
    draft_tokens: torch.Tensor,  # [B, k]
    target_choice: torch.Tensor,  # [B, k + 1] the target's argmax after the last committed token, then each draft's
) -> Verdict:
    """The greedy verdict from the target's choices: the longest draft prefix equal to them, then its choice."""
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_choice[:, :k]).long()  # [B, k]
    num_accepted = matches.cumprod(-1).sum(-1)  # [B]
    next_token = target_choice.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return Verdict(num_accepted, next_token)


def verify_sampled(
    draft_tokens: torch.Tensor,  # [B, k]
    q_draft: torch.Tensor | None,  # [B, k, V] what each draft token was drawn from; None = deterministic
    p_target: torch.Tensor,  # [B, k + 1, V] warped target probabilities
    generator: torch.Generator,
) -> Verdict:
    """Exact speculative sampling over a chain: the committed tokens are distributed as the target's."""
    batch, k = draft_tokens.shape
    p_at_draft = p_target[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    if q_draft is None:
        q_at_draft = torch.ones_like(p_at_draft)
    else:
        q_at_draft = q_draft.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    uniform = torch.rand(batch, k, generator=generator, device=p_target.device)  # [B, k]
    # u < p/q written without a division: a token with q = 0 is accepted iff p > 0.
    accepted = (uniform * q_at_draft < p_at_draft).long()  # [B, k]
    num_accepted = accepted.cumprod(-1).sum(-1)  # [B]

    # Only the row after the accepted prefix is drawn from: the residual there (recovered), or p's last row (bonus).
    vocab = p_target.shape[-1]
    row = num_accepted.view(batch, 1, 1)  # [B, 1, 1]
    p_row = p_target.gather(1, row.expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    if k == 0:
        return Verdict(num_accepted, sample(p_row, generator))
    judged = row.clamp_max(k - 1)  # [B, 1, 1]: the rejected token's position (any, after a full acceptance)
    q_row = None if q_draft is None else q_draft.gather(1, judged.expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    residual = residual_distribution(p_row, q_row, draft_tokens.gather(1, judged.view(batch, 1)).squeeze(1))  # [B, V]
    recovering = (num_accepted < k).unsqueeze(1)  # [B, 1]
    next_token = sample(torch.where(recovering, residual, p_row), generator)  # [B]
    return Verdict(num_accepted, next_token)


def verify_tree(
    tokens: torch.Tensor,  # [n] the tree's tokens, parents earlier than children
    layout: TreeLayout,
    p_target: torch.Tensor,  # [n + 1, V] warped target probabilities (greedy: logits do); row 0 = after the root
    q_draft: torch.Tensor | None = None,  # [n, V] what each token was drawn from; None = all deterministic
    generator: torch.Generator | None = None,  # None: greedy
) -> Verdict:
    """Walk down the tree keeping exactly what the target would have produced.

    At each accepted node (starting at the root) its children are tried in index order.
    Greedy: a child is accepted when it is the target's argmax there. Sampling (multi-draft
    recursive rejection, SpecInfer): child x, drawn from q, is accepted with probability
    min(1, p'(x) / q(x)), where p' is the target's distribution at the node with the earlier
    rejected siblings taken out, p' <- normalize(max(p' - q, 0)); a deterministic child is
    a point mass (q = one-hot), so it is accepted with probability p'(x) and removed from p'
    on rejection. When no child is accepted, the next token is drawn from the last p' (the
    recovered token), or from p itself below a leaf (the bonus). Exact when the children of a
    node are deterministic or independent draws from their q.

    Every test is decided for all tokens at once: a token's p' depends only on its earlier
    siblings being rejected, which is what its test is conditioned on anyway.
    """
    n = tokens.shape[0]
    parent_rows = layout.parent_rows  # [n]
    if generator is None:
        choice = p_target.argmax(-1)  # [n + 1]
        passed = tokens == choice[parent_rows]  # [n]
    else:
        uniform = torch.rand(n, generator=generator, device=p_target.device)  # [n]
        residual = p_target.clone()  # [n + 1, V]: p' per row, after the siblings tried so far
        p_at_token = torch.empty(n, device=p_target.device)
        q_at_token = torch.ones(n, device=p_target.device)
        for nodes in layout.by_rank:  # each parent has at most one child of a given rank
            rows = parent_rows[nodes]
            current = residual[rows]  # [m, V]
            drawn = tokens[nodes]  # [m]
            p_at_token[nodes] = current.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
            q_rows = None if q_draft is None else q_draft[nodes]  # [m, V]
            if q_rows is not None:
                q_at_token[nodes] = q_rows.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)
            residual[rows] = residual_distribution(current, q_rows, drawn)
        # u < p'/q written without a division: a token with q = 0 is accepted iff p' > 0.
        passed = uniform * q_at_token < p_at_token  # [n]

    # A child is chosen when it passed and no earlier sibling did; accepted when it and all its ancestors were chosen.
    chosen = torch.zeros(n, dtype=torch.bool, device=tokens.device)
    taken = torch.zeros(n + 1, dtype=torch.bool, device=tokens.device)  # per parent row: a child was chosen
    for nodes in layout.by_rank:
        rows = parent_rows[nodes]
        pick = passed[nodes] & ~taken[rows]
        chosen[nodes] = pick
        taken[rows] |= pick
    accepted = ~(layout.ancestors & ~chosen.unsqueeze(0)).any(-1)  # [n]: the accepted path
    num_accepted = accepted.sum().view(1)
    deepest = torch.where(accepted, layout.depth, 0).argmax().view(1)
    last_node = torch.where(num_accepted > 0, deepest, -1)
    if generator is None:
        next_token = choice.gather(0, last_node + 1)  # [1]
    else:  # drawn from the one row the path ends at: its p' after every child was tried (p below a leaf)
        next_token = sample(residual.index_select(0, last_node + 1), generator)  # [1]
    return Verdict(num_accepted, next_token, last_node)
