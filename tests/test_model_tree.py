"""Tree drafts of the `model` drafter through the engine (tiny random models).

Tier 3: greedy output with trees equals plain decoding for drafts from identical to
independent, several budgets, branchings and k (fixed and auto), with a repetition penalty
too. The draft's cache after a tree step must be what a plain pass over the accepted path
would have left: with a draft identical to the target, every step's accepted path is the
tree's whole top line (a corrupted draft cache would mispredict and break that).
"""

import pytest

from specdraft import ModelDrafter, SamplingParams, SpeculativeDecoder
from specdraft.errors import SpecdraftError

PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(10, 40))]


@pytest.mark.parametrize("k,budget,branch", [(3, 6, 2), (4, 10, 3), ("auto", 16, 4), (2, 5, 5)])
@pytest.mark.parametrize("draft_name", ["identical", "close", "far", "independent"])
def test_greedy_tree_equals_ar(tiny_target, drafts, make_lm, draft_name, k, budget, branch):
    ar = SpeculativeDecoder(make_lm(tiny_target))
    drafter = ModelDrafter(make_lm(drafts[draft_name]), min_confidence=0.05)
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=k, tree_budget=budget, tree_branch=branch)
    drafted = []
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=40)
        got = spec.generate(prompt, max_new_tokens=40)
        assert got.token_ids == expected.token_ids
        stats = got.stats
        assert stats.new_tokens == 40
        assert all(len(path) == accepted for path, accepted in zip(stats.path_per_step, stats.accepted_per_step))
        assert all(accepted <= depth for accepted, depth in zip(stats.accepted_per_step, stats.depth_per_step))
        drafted.append(stats.drafted)
    # A fixed k always drafts; auto drafts on its first step (nothing measured yet), then as the measured
    # costs say (on a tiny model a draft's read of a 30-token prompt may never pay in a 40-token answer).
    assert all(drafted) if k != "auto" else drafted[0] > 0


def test_trees_branch_and_raise_tau(tiny_target, drafts, make_lm):
    """A close draft with trees: some steps are real trees (more nodes than depth), and τ beats
    a chain of the same depth on the same prompt."""
    def run(**tree):
        drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.05)
        return SpeculativeDecoder(make_lm(tiny_target), drafter, k=4, **tree).generate(PROMPTS[2], max_new_tokens=60)

    chain, tree = run(), run(tree_budget=12, tree_branch=3)
    assert any(k > depth for k, depth in zip(tree.stats.k_per_step, tree.stats.depth_per_step))
    assert tree.stats.mean_committed_per_step > chain.stats.mean_committed_per_step


def test_identical_draft_accepts_the_whole_top_line(tiny_target, drafts, make_lm):
    """With the target's own weights as draft, the draft's likeliest line is the target's greedy
    line, so each step accepts as deep as the tree goes: the draft cache stayed right after every keep."""
    drafter = ModelDrafter(make_lm(drafts["identical"]), min_confidence=0.0)
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=4, tree_budget=9, tree_branch=3)
    stats = spec.generate(PROMPTS[0], max_new_tokens=41).stats
    full = [depth for depth, k in zip(stats.depth_per_step, stats.k_per_step) if k > 0]
    assert stats.accepted_per_step[: len(full)] == full
    assert stats.mean_committed_per_step > 2.0


@pytest.mark.parametrize("settings", [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=1.5, top_k=5),
])
def test_greedy_tree_with_repetition_penalty_equals_ar(tiny_target, drafts, make_lm, settings):
    params = SamplingParams(**settings)
    ar = SpeculativeDecoder(make_lm(tiny_target)).generate(PROMPTS[2], params, max_new_tokens=40)
    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.05)
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=4, tree_budget=10, tree_branch=3)
    assert spec.generate(PROMPTS[2], params, max_new_tokens=40).token_ids == ar.token_ids


def test_sampled_trees_are_reproducible_and_seed_dependent(tiny_target, drafts, make_lm):
    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.05)
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=4, tree_budget=10, tree_branch=3)
    runs = [spec.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=seed), max_new_tokens=30).token_ids
            for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("budget,branch", [(2, 3), (7, 2), (12, 4)])
def test_sampled_trees_keep_to_the_budget(tiny_target, drafts, make_lm, budget, branch):
    """Every level keeps room for its drawn node: a budget of 2 under k = 6 is a chain of 2 (a sibling only where
    the answer's end allows one level), larger budgets branch."""
    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.0)
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=6, tree_budget=budget, tree_branch=branch)
    stats = spec.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=4), max_new_tokens=40).stats
    assert max(stats.k_per_step) <= budget
    branched = [depth for k, depth in zip(stats.k_per_step, stats.depth_per_step) if k > depth]
    assert set(branched) <= {1} if budget == 2 else branched


def test_sampled_trees_are_the_sampled_chain_with_leaf_siblings(tiny_target, drafts, make_lm):
    """One node a level goes on (the drawn one, first among its siblings); the siblings fill the shallowest
    levels while each deeper level keeps room for its drawn node, so the tree is as deep as the chain."""
    drafter = ModelDrafter(make_lm(drafts["close"]), min_confidence=0.0)
    grown = []
    propose = drafter.propose
    drafter.propose = lambda ctx, k: grown.append(propose(ctx, k)) or grown[-1]
    spec = SpeculativeDecoder(make_lm(tiny_target), drafter, k=4, tree_budget=10, tree_branch=3)
    spec.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=4), max_new_tokens=40)
    for draft in grown:
        parents = draft.parents.tolist()
        depths = []
        for parent in parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        sizes = [depths.count(d) for d in range(1, max(depths) + 1)]
        assert sizes == sorted(sizes, reverse=True)  # siblings at the top
        expanded = sorted({parent for parent in parents if parent >= 0})
        assert len(expanded) == max(depths) - 1  # one node a level goes on
        first_children = {parent: parents.index(parent) for parent in [-1, *expanded]}
        assert all(first_children[parents[node]] == node for node in expanded)  # and it is the drawn one
    assert grown[0].k == 10 and grown[0].layout.height == 4  # levels of 3, 3, 3 and 1


@pytest.mark.parametrize("budget,branch", [(-1, 2), (4, 0), (2.5, 2)])
def test_bad_tree_options_are_refused(tiny_target, make_lm, budget, branch):
    with pytest.raises(SpecdraftError, match="tree"):
        SpeculativeDecoder(make_lm(tiny_target), None, tree_budget=budget, tree_branch=branch)
