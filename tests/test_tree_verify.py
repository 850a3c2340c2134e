"""Tree verification, tiers 1 and 2.

Tier 1, hand-built logits: greedy `verify_tree` keeps the deepest path of argmax matches, takes the right branch when
the first one mismatches, resolves duplicate siblings in index order, commits the root's argmax when nothing matches
and the bonus from the leaf's row after a full path; on a chain it agrees with `verify_greedy` (and, sampling, with
`verify_sampled` draw for draw under the same seed).

Tier 2, statistics: a toy Markov "LM" on V = 6 tokens (next-token logits depend only on the last token; target P,
draft Q). Each trial drafts one fixed-shape tree after X0 (deterministic top-ranked children, children drawn i.i.d.
from warp(Q), or a mix with one-hot q rows) and runs `verify_tree`. The first two committed tokens must follow the
target's two-step distribution warp(P)[X0, a] * warp(P)[a, b]: a chi-square test on the first token's counts and on
the joint counts. The same test must reject two deliberately wrong verifiers, built here from a batched copy of the
algorithm (the copy is first checked to make the library's decisions draw for draw): one that never takes rejected
siblings out of p', one that draws the recovered token from p.
"""

from __future__ import annotations

import pytest
import torch

from specdraft.goodness_of_fit import chi_square_pvalue
from specdraft.sampling import SamplingParams, sample, warp
from specdraft.tree import TreeLayout
from specdraft.verify import verify_greedy, verify_sampled, verify_tree
from seeded import gen, transition_logits


# ---------------------------------------------------------------------------------------------
# 2. Tier 1: greedy verify_tree on hand-built logits
# ---------------------------------------------------------------------------------------------

V_HAND = 6

# node:      0   1   2   3  4  5  6
# parents: [-1, -1, -1,  0, 0, 1, 3]
#     root ── 0 ── 3 ── 6
#         │    └── 4
#         ├── 1 ── 5
#         └── 2
# rows: 0 = after the root, i + 1 = after node i
HAND_PARENTS = [-1, -1, -1, 0, 0, 1, 3]
HAND_TOKENS = torch.tensor([1, 2, 3, 4, 5, 4, 0])
UNUSED = 3  # a row's argmax where it does not matter


def one_hot_logits(argmaxes: list[int], vocab: int = V_HAND) -> torch.Tensor:
    """Logits `[len(argmaxes), vocab]` whose row i has its unique maximum at argmaxes[i]."""
    rows = torch.arange(vocab, dtype=torch.float32).repeat(len(argmaxes), 1) * 0.1  # small slope, no ties
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


def greedy(tokens: torch.Tensor, parents: list[int], row_argmax: list[int]) -> tuple[int, int, int]:
    """(num_accepted, next_token, last_node) of greedy verify_tree, logits built from the row argmaxes."""
    verdict = verify_tree(tokens, TreeLayout.from_parents(parents), one_hot_logits(row_argmax))
    assert verdict.num_accepted.shape == verdict.next_token.shape == verdict.last_node.shape == (1,)
    return verdict.num_accepted.item(), verdict.next_token.item(), verdict.last_node.item()


def test_greedy_tree_accepts_the_deepest_matching_path():
    # root wants 1 (node 0), after node 0 wants 4 (node 3), after node 3 wants 0 (node 6, a leaf):
    # the bonus is the argmax of node 6's row, 2.
    rows = [1, 4, UNUSED, UNUSED, 0, UNUSED, UNUSED, 2]
    assert greedy(HAND_TOKENS, HAND_PARENTS, rows) == (3, 2, 6)


def test_greedy_tree_takes_the_second_branch_when_the_first_mismatches():
    # root wants 2: node 0 (token 1) mismatches, node 1 (token 2) matches; after node 1 wants 4 (node 5,
    # a leaf): bonus from row 6. Row 1 (after node 0) would match node 3 but node 0 was rejected.
    rows = [2, 4, 4, UNUSED, UNUSED, UNUSED, 5, UNUSED]
    assert greedy(HAND_TOKENS, HAND_PARENTS, rows) == (2, 5, 5)


def test_greedy_tree_second_child_at_depth_two():
    # root wants 1 (node 0); after node 0 wants 5: node 3 (4) mismatches, node 4 (5) matches, a leaf.
    rows = [1, 5, UNUSED, UNUSED, 0, 1, UNUSED, UNUSED]
    assert greedy(HAND_TOKENS, HAND_PARENTS, rows) == (2, 1, 4)


def test_greedy_tree_stops_where_no_child_matches():
    # root wants 1 (node 0); after node 0 wants 2, which neither child (4, 5) is: recovered 2.
    rows = [1, 2, UNUSED, UNUSED, 0, UNUSED, UNUSED, UNUSED]
    assert greedy(HAND_TOKENS, HAND_PARENTS, rows) == (1, 2, 0)


def test_greedy_tree_nothing_accepted_commits_the_root_argmax():
    rows = [5, 4, 4, 0, 0, 0, 0, 0]  # every deeper row would match something; the root's does not
    assert greedy(HAND_TOKENS, HAND_PARENTS, rows) == (0, 5, -1)


def test_greedy_tree_leaf_at_depth_one_gives_the_bonus_from_its_row():
    rows = [3, UNUSED, UNUSED, 1, UNUSED, UNUSED, UNUSED, UNUSED]  # root wants 3: node 2, a leaf
    assert greedy(HAND_TOKENS, HAND_PARENTS, rows) == (1, 1, 2)


def test_greedy_tree_duplicate_siblings_take_the_first_in_index_order():
    # Nodes 0 and 1 are both token 3 (a real target gives them identical rows). The first one is taken;
    # its child (token 1) mismatches the row's argmax 2, so 2 is recovered; node 1's subtree is ignored
    # even though its child (token 2) would have matched.
    parents = [-1, -1, 0, 1]
    tokens = torch.tensor([3, 3, 1, 2])
    assert greedy(tokens, parents, [3, 2, 2, UNUSED, UNUSED]) == (1, 2, 0)
    # ...and when the first duplicate's child matches, the path goes through it.
    assert greedy(tokens, parents, [3, 1, 1, 4, UNUSED]) == (2, 4, 2)


def test_greedy_tree_duplicate_children_of_one_node():
    # Both children of node 0 are token 4; the first (node 1) is accepted, its row gives the bonus.
    parents = [-1, 0, 0]
    tokens = torch.tensor([2, 4, 4])
    assert greedy(tokens, parents, [2, 4, 5, 0]) == (2, 5, 1)


def test_greedy_tree_accepts_probabilities_as_well_as_logits():
    layout = TreeLayout.from_parents(HAND_PARENTS)
    logits = one_hot_logits([1, 4, UNUSED, UNUSED, 0, UNUSED, UNUSED, 2])
    a, b = verify_tree(HAND_TOKENS, layout, logits), verify_tree(HAND_TOKENS, layout, logits.softmax(-1))
    assert (a.num_accepted, a.next_token, a.last_node) == (b.num_accepted, b.next_token, b.last_node)


CHAIN_CASES = 200
CHAIN_K = 5
CHAIN_SEED = 11


def test_greedy_chain_layout_matches_verify_greedy():
    """Random chains whose tokens match the target's argmax for a random prefix (and randomly after)."""
    g = gen(CHAIN_SEED)
    layout = TreeLayout.from_parents(list(range(-1, CHAIN_K - 1)))
    outcomes = set()
    for _ in range(CHAIN_CASES):
        logits = torch.randn(CHAIN_K + 1, V_HAND, generator=g)
        argmax = logits.argmax(-1)
        keep = torch.rand(CHAIN_K, generator=g) < 0.7  # each position matches with probability 0.7
        tokens = torch.where(keep, argmax[:CHAIN_K], torch.randint(0, V_HAND, (CHAIN_K,), generator=g))
        tree = verify_tree(tokens, layout, logits)
        chain = verify_greedy(tokens.unsqueeze(0), logits.unsqueeze(0))
        assert tree.num_accepted.tolist() == chain.num_accepted.tolist()
        assert tree.next_token.tolist() == chain.next_token.tolist()
        assert tree.last_node.item() == chain.num_accepted.item() - 1
        outcomes.add(chain.num_accepted.item())
    assert outcomes == set(range(CHAIN_K + 1))  # every acceptance length was exercised


@pytest.mark.parametrize("deterministic", [True, False])
def test_sampled_chain_layout_matches_verify_sampled_draw_for_draw(deterministic):
    """On a chain, tree verification is the chain verifier: same verdicts from the same seed."""
    g = gen(CHAIN_SEED)
    layout = TreeLayout.from_parents(list(range(-1, CHAIN_K - 1)))
    outcomes = set()
    for case in range(CHAIN_CASES):
        p = (2.0 * torch.randn(CHAIN_K + 1, V_HAND, generator=g)).softmax(-1)
        q = None if deterministic else (2.0 * torch.randn(CHAIN_K, V_HAND, generator=g)).softmax(-1)
        tokens = p[:CHAIN_K].argmax(-1) if deterministic else sample(q, g)
        tree = verify_tree(tokens, layout, p, q, gen(case))
        chain = verify_sampled(tokens.unsqueeze(0), None if q is None else q.unsqueeze(0), p.unsqueeze(0), gen(case))
        assert tree.num_accepted.tolist() == chain.num_accepted.tolist()
        assert tree.next_token.tolist() == chain.next_token.tolist()
        outcomes.add(chain.num_accepted.item())
    assert len(outcomes) >= 4


# ---------------------------------------------------------------------------------------------
# 3. Tier 2: statistics on a toy Markov LM
# ---------------------------------------------------------------------------------------------

V = 6
X0 = 2
TRIALS = 12_000
P_PASS = 1e-3  # the correct verifier must pass
P_REJECT = 1e-6  # a wrong verifier must fail

# node:       0   1   2  3  4  5  6
#     X0 ── 0 ── 3 ── 6
#        │    └── 4
#        ├── 1 ── 5
#        └── 2
STAT_PARENTS = [-1, -1, -1, 0, 0, 1, 3]
STAT_LAYOUT = TreeLayout.from_parents(STAT_PARENTS)
STAT_RANKS = [0, 1, 2, 0, 1, 0, 0]  # sibling rank of each node
FIRST_ON_PATH = [STAT_LAYOUT.path(i)[0] for i in range(len(STAT_PARENTS))]  # depth-1 node of each path
SECOND_ON_PATH = [(STAT_LAYOUT.path(i) + [-1, -1])[1] for i in range(len(STAT_PARENTS))]  # depth-2 node or -1


P_LOGITS, Q_LOGITS = transition_logits(20240611, V)
Q_ORDER = Q_LOGITS.argsort(-1, descending=True)  # [V, V]: the draft's tokens by rank after each token

# How each node is drafted:
TOP = "top"  # deterministic: the r-th likeliest token of Q for a rank-r child (q_draft None)
SAMPLED = "sampled"  # drawn from warp(Q) at the parent's token, independently of its siblings
ONE_HOT = "one-hot"  # like TOP, but verified through a one-hot q row
CASES = {
    "deterministic": [TOP] * 7,
    "iid": [SAMPLED] * 7,
    "mixed": [ONE_HOT, SAMPLED, ONE_HOT, SAMPLED, ONE_HOT, ONE_HOT, SAMPLED],
}
SETTINGS = {
    "T=1.0": SamplingParams(temperature=1.0),
    "T=1,top_k=3": SamplingParams(temperature=1.0, top_k=3),
}


def _draft_trees(kinds: list[str], params: SamplingParams, generator: torch.Generator, trials: int):
    """`trials` independent trees after X0: tokens `[B, n]`, target rows `[B, n + 1, V]`, q rows
    `[B, n, V]` (None when every node is TOP)."""
    p_table, q_table = warp(P_LOGITS, params), warp(Q_LOGITS, params)
    n = len(kinds)
    tokens = torch.empty(trials, n, dtype=torch.long)
    q_rows = torch.empty(trials, n, V)
    for i, (kind, parent, rank) in enumerate(zip(kinds, STAT_PARENTS, STAT_RANKS)):
        after = torch.full((trials,), X0) if parent < 0 else tokens[:, parent]  # [B]
        if kind == SAMPLED:
            tokens[:, i] = sample(q_table[after], generator)
            q_rows[:, i] = q_table[after]
        else:
            tokens[:, i] = Q_ORDER[after, rank]
            q_rows[:, i] = torch.nn.functional.one_hot(tokens[:, i], V).float()
    p_rows = p_table[torch.cat([torch.full((trials, 1), X0), tokens], 1)]  # [B, n + 1, V]
    return tokens, p_rows, None if all(kind == TOP for kind in kinds) else q_rows


def _library_verifier(tokens, p_rows, q_rows, generator):
    """verify_tree, one tree at a time: `(last_node [B], next_token [B])`."""
    verdicts = []
    for b in range(tokens.shape[0]):
        verdict = verify_tree(tokens[b], STAT_LAYOUT, p_rows[b], None if q_rows is None else q_rows[b], generator)
        verdicts.append(torch.cat([verdict.num_accepted, verdict.last_node, verdict.next_token]))
    num_accepted, last_node, next_token = torch.stack(verdicts).unbind(1)
    assert torch.equal(num_accepted, torch.where(last_node >= 0, STAT_LAYOUT.depth[last_node.clamp_min(0)], 0))
    return last_node, next_token


def _batched_tree_verifier(tokens, p_rows, q_rows, generator, *, chain_residual=True, recover_from_residual=True):
    """A batched copy of verify_tree's sampling algorithm, `(last_node [B], next_token [B])`, with two
    switchable bugs: `chain_residual=False` judges every sibling by the parent's p (rejected siblings
    are never taken out of p'; the recovered token comes from p minus the last sibling only), and
    `recover_from_residual=False` draws the recovered token from p itself."""
    layout = STAT_LAYOUT
    batch, n = tokens.shape
    parent_rows = layout.parent_rows  # [n]
    uniform = torch.rand(batch, n, generator=generator)  # [B, n]
    residual = p_rows.clone()  # [B, n + 1, V]
    p_at_token = torch.empty(batch, n)
    q_at_token = torch.ones(batch, n)
    for nodes in layout.by_rank:
        rows = parent_rows[nodes]
        current = (residual if chain_residual else p_rows)[:, rows]  # [B, m, V]
        drawn = tokens[:, nodes].unsqueeze(-1)  # [B, m, 1]
        p_at_token[:, nodes] = current.gather(-1, drawn).squeeze(-1)
        if q_rows is None:
            rest = current.scatter(-1, drawn, 0.0)
        else:
            q = q_rows[:, nodes]  # [B, m, V]
            q_at_token[:, nodes] = q.gather(-1, drawn).squeeze(-1)
            rest = (current - q).clamp_min(0.0)
        mass = rest.sum(-1, keepdim=True)
        empty = mass <= 1e-12
        residual[:, rows] = torch.where(empty, current, rest / torch.where(empty, 1.0, mass))
    passed = uniform * q_at_token < p_at_token  # [B, n]
    chosen = torch.zeros(batch, n, dtype=torch.bool)
    taken = torch.zeros(batch, n + 1, dtype=torch.bool)
    for nodes in layout.by_rank:
        rows = parent_rows[nodes]
        pick = passed[:, nodes] & ~taken[:, rows]
        chosen[:, nodes] = pick
        taken[:, rows] |= pick
    accepted = ~(layout.ancestors.unsqueeze(0) & ~chosen.unsqueeze(1)).any(-1)  # [B, n]
    deepest = torch.where(accepted, layout.depth, 0).argmax(-1)  # [B]
    last_node = torch.where(accepted.any(-1), deepest, -1)
    recover_from = residual if recover_from_residual else p_rows  # [B, n + 1, V]
    end_row = (last_node + 1).view(batch, 1, 1).expand(batch, 1, V)
    next_token = sample(recover_from.gather(1, end_row).squeeze(1), generator)  # [B]: from the row the path ends at
    return last_node, next_token


def _first_two_committed(kinds, params, verifier, seed: int, trials: int = TRIALS):
    """The first two committed tokens (a, b) of `trials` independent generations from X0, and the
    accepted path length of each trial's first step."""
    generator = gen(seed)
    tokens, p_rows, q_rows = _draft_trees(kinds, params, generator, trials)
    last_node, next_token = verifier(tokens, p_rows, q_rows, generator)
    on_path = last_node >= 0
    node = last_node.clamp_min(0)
    first_node = torch.tensor(FIRST_ON_PATH)[node]
    second_node = torch.tensor(SECOND_ON_PATH)[node]
    length = torch.where(on_path, STAT_LAYOUT.depth[node], 0)
    row = torch.arange(trials)
    first = torch.where(length >= 1, tokens[row, first_node], next_token)
    second = torch.where(length >= 2, tokens[row, second_node.clamp_min(0)], next_token)
    # Nothing accepted: the step committed one token; the next comes from a plain target step.
    plain = sample(warp(P_LOGITS, params)[first], generator)
    second = torch.where(length == 0, plain, second)
    return first, second, length


def _pvalues(first: torch.Tensor, second: torch.Tensor, params: SamplingParams) -> tuple[float, float]:
    """Chi-square p-values of the first token's counts and of the (first, second) counts."""
    p_table = warp(P_LOGITS, params).double().numpy()
    p_table /= p_table.sum(-1, keepdims=True)  # exact float64 rows, so the expected counts sum to the trials
    joint = p_table[X0][:, None] * p_table
    trials = first.shape[0]
    observed_first = torch.bincount(first, minlength=V).double().numpy()
    observed_joint = torch.bincount(first * V + second, minlength=V * V).double().numpy()
    return (chi_square_pvalue(observed_first, p_table[X0] * trials),
            chi_square_pvalue(observed_joint, joint.ravel() * trials))


def test_toy_lm_is_nontrivial():
    """The draft differs from the target enough that rejections, later siblings and residuals matter."""
    params = SETTINGS["T=1.0"]
    p_table, q_table = warp(P_LOGITS, params), warp(Q_LOGITS, params)
    tv = 0.5 * (p_table - q_table).abs().sum(-1)  # [V]
    assert tv[X0] > 0.25 and tv.mean() > 0.25
    agree = P_LOGITS.argmax(-1) == Q_LOGITS.argmax(-1)
    assert agree.any() and not agree.all()
    top_k = SETTINGS["T=1,top_k=3"]
    assert ((warp(P_LOGITS, top_k) == 0) & (warp(Q_LOGITS, top_k) > 0)).any()


def test_batched_copy_makes_the_library_decisions():
    """The copy the negative controls break is the library's algorithm: same verdicts, draw for draw."""
    for kinds in CASES.values():
        tokens, p_rows, q_rows = _draft_trees(kinds, SETTINGS["T=1.0"], gen(3), 300)
        for b in range(tokens.shape[0]):
            q = None if q_rows is None else q_rows[b]
            ours = _batched_tree_verifier(tokens[b : b + 1], p_rows[b : b + 1], None if q is None else q[None], gen(b))
            theirs = verify_tree(tokens[b], STAT_LAYOUT, p_rows[b], q, gen(b))
            assert [ours[0].item(), ours[1].item()] == [theirs.last_node.item(), theirs.next_token.item()]


@pytest.mark.parametrize(("case", "setting"), [  # the mixed tree in the quick set, each about 10 s on 2 cores
    pytest.param("deterministic", "T=1.0", marks=pytest.mark.slow),
    pytest.param("iid", "T=1.0", marks=pytest.mark.slow),
    ("mixed", "T=1.0"),
    pytest.param("iid", "T=1,top_k=3", marks=pytest.mark.slow),
])
def test_tree_committed_tokens_follow_the_target(case, setting):
    params = SETTINGS[setting]
    first, second, length = _first_two_committed(CASES[case], params, _library_verifier, seed=1)
    # every branch of the harness is exercised: recovered at the root, after depth 1, and deeper
    for depth in (0, 1, 2):
        assert (length == depth).sum() > 0.02 * TRIALS, f"path length {depth} too rare"
    p_first, p_joint = _pvalues(first, second, params)
    assert p_first > P_PASS and p_joint > P_PASS, f"{case} {setting}: p-values {p_first:.3g}, {p_joint:.3g}"


# Bugs planted in the copy of the verifier: a keyword it takes, and what the bug does.
PLANTED_BUGS = {"chain_residual": "siblings judged by p", "recover_from_residual": "recovery from p"}


@pytest.mark.parametrize("bug, case", [("chain_residual", c) for c in ("deterministic", "iid")]
                         + [("recover_from_residual", c) for c in ("deterministic", "iid", "mixed")])
def test_negative_controls_are_caught(bug, case):
    params = SETTINGS["T=1.0"]
    first, second, _ = _first_two_committed(
        CASES[case], params, lambda *a: _batched_tree_verifier(*a, **{bug: False}), seed=1)
    p_first, p_joint = _pvalues(first, second, params)
    assert p_joint < P_REJECT, f"{PLANTED_BUGS[bug]} went unnoticed: p-values {p_first:.3g}, {p_joint:.3g}"


def test_negative_controls_are_real_bugs_of_the_copy():
    """...whereas the unbroken copy passes the same test (so the rejections come from the bugs)."""
    params = SETTINGS["T=1.0"]
    for case, kinds in CASES.items():
        first, second, _ = _first_two_committed(kinds, params, _batched_tree_verifier, seed=1)
        p_first, p_joint = _pvalues(first, second, params)
        assert p_first > P_PASS and p_joint > P_PASS, f"{case}: p-values {p_first:.3g}, {p_joint:.3g}"
