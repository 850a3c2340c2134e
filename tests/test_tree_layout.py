"""Token trees: `TreeLayout` (tree.py's worked example, chains, invalid parent lists, the positions and visibility
of one block pass) and drafts that are trees."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters.base import Draft
from specdraft.errors import SpecdraftError
from specdraft.tree import TreeLayout



# ---------------------------------------------------------------------------------------------
# 1. TreeLayout
# ---------------------------------------------------------------------------------------------

# tree.py's worked example: tokens [a, b, c, d]
#     root ── a ── c
#         │    └── d
#         └── b
EXAMPLE_PARENTS = [-1, -1, 0, 0]
A, B_, C, D = 0, 1, 2, 3  # node indices of a, b, c, d


def test_layout_worked_example():
    layout = TreeLayout.from_parents(EXAMPLE_PARENTS)
    assert layout.size == 4
    assert layout.depth.tolist() == [1, 1, 2, 2]
    # sibling ranks [0, 1, 0, 1]: rank 0 holds a and c, rank 1 holds b and d
    assert [r.tolist() for r in layout.by_rank] == [[A, C], [B_, D]]
    assert layout.width == 2
    assert layout.parent_rows.tolist() == [0, 0, 1, 1]  # a, b judged by the root's row; c, d by a's
    assert layout.path(D) == [A, D]
    assert layout.path(C) == [A, C]
    assert layout.path(B_) == [B_]
    assert layout.path(-1) == []
    # d attends to the root (implicitly), a and itself
    assert layout.ancestors.tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [True, False, True, False],
        [True, False, False, True],
    ]
    assert [layout.is_leaf(i) for i in (-1, A, B_, C, D)] == [False, False, True, True, True]
    assert not layout.is_chain


def test_layout_chain_and_empty_tree():
    chain = TreeLayout.from_parents([-1, 0, 1, 2])
    assert chain.is_chain and chain.width == 1
    assert chain.depth.tolist() == [1, 2, 3, 4]
    assert chain.path(3) == [0, 1, 2, 3]
    assert chain.ancestors.tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    assert [chain.is_leaf(i) for i in range(4)] == [False, False, False, True]
    # a single branch point makes it a tree
    assert not TreeLayout.from_parents([-1, 0, 0]).is_chain
    empty = TreeLayout.from_parents([])
    assert empty.size == 0 and empty.is_chain and empty.width == 0
    assert empty.is_leaf(-1)  # the root is a leaf only of an empty tree


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 5], [-2], [-1, 0, 3], [-1, -1, 2, 1]])
def test_layout_rejects_invalid_parents(parents):
    with pytest.raises(SpecdraftError):
        TreeLayout.from_parents(parents)


def test_block_attention_prefix_one():
    """One plain token (the root itself) and the tree: positions by depth, ancestors-only visibility."""
    offsets, visible = TreeLayout.from_parents(EXAMPLE_PARENTS).block_attention(1)
    assert offsets.tolist() == [0, 1, 1, 2, 2]
    T, F = True, False
    assert visible.tolist() == [
        [T, F, F, F, F],  # root
        [T, T, F, F, F],  # a
        [T, F, T, F, F],  # b
        [T, T, F, T, F],  # c
        [T, T, F, F, T],  # d
    ]


def test_block_attention_prefix_two():
    """Two plain tokens before the tree: the plain part is causal, the tree hangs off the second."""
    offsets, visible = TreeLayout.from_parents(EXAMPLE_PARENTS).block_attention(2)
    assert offsets.tolist() == [0, 1, 2, 2, 3, 3]
    T, F = True, False
    assert visible.tolist() == [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [T, T, T, F, F, F],  # a
        [T, T, F, T, F, F],  # b
        [T, T, T, F, T, F],  # c
        [T, T, T, F, F, T],  # d
    ]


def test_draft_tree_is_a_chain_draft_when_the_parents_are_a_chain():
    tokens = torch.tensor([5, 6, 7])
    chain = Draft.tree(tokens, [-1, 0, 1])
    assert chain.layout is None and chain.parents.tolist() == [-1, 0, 1]
    tree = Draft.tree(tokens, [-1, -1, 0])
    assert tree.layout is not None and tree.layout.parents == (-1, -1, 0)
    assert tree.parents.tolist() == [-1, -1, 0] and tree.k == 3


def test_a_chain_and_a_tree_answer_the_steps_questions_alike():
    """What a step asks of a draft, chain or tree: the accepted path to its deepest node, whether the next token is a
    bonus, how deep it goes, and how a pass attends to it (a chain: consecutive and causal, no tensors)."""
    chain = Draft.chain(torch.tensor([5, 6, 7]))
    assert chain.is_chain and chain.height == 3 and chain.path(-1) == [] and chain.path(1) == [0, 1]
    assert [chain.is_bonus(node) for node in (-1, 1, 2)] == [False, False, True]
    assert chain.block_attention(2) == (None, None) and chain.rows_ancestors() is None
    tree = Draft.tree(torch.tensor([1, 2, 3, 4]), EXAMPLE_PARENTS)
    assert not tree.is_chain and tree.height == 2 and tree.path(D) == [A, D] and tree.path(-1) == []
    assert [tree.is_bonus(node) for node in (-1, A, B_, D)] == [False, False, True, True]
    offsets, visible = tree.block_attention(2)
    expected = tree.layout.block_attention(2)
    assert torch.equal(offsets, expected[0]) and torch.equal(visible, expected[1])
    assert torch.equal(tree.rows_ancestors(), tree.layout.rows_ancestors())
    assert Draft.chain(torch.tensor([], dtype=torch.long)).is_bonus(-1)  # nothing drafted: the target's token


def test_a_drafts_prefix_is_the_tree_of_its_first_tokens():
    """`prefix(n)`: tokens, parents, q rows and scores of the first n; a tree whose prefix is a chain becomes one."""
    tokens, q = torch.tensor([5, 6, 7, 8]), torch.eye(9)[[5, 6, 7, 8]]
    tree = Draft.tree(tokens, [-1, -1, 0, 2], q, scores=[0.9, 0.5, 0.4, 0.2])
    three = tree.prefix(3)
    assert three.tokens.tolist() == [5, 6, 7] and three.layout.parents == (-1, -1, 0) and three.scores == [0.9, 0.5, 0.4]
    assert torch.equal(three.q_draft, q[:3])
    one = tree.prefix(1)
    assert one.layout is None and one.parents.tolist() == [-1] and one.k == 1
    assert tree.prefix(4) is tree and tree.prefix(9) is tree
