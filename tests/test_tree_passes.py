"""Tree passes of a tiny random float32 Qwen2 through `CausalLM`: every row of a tree pass equals a plain pass along
that token's path; `keep(start, path)` leaves the cache a plain pass over the path would have left; `keep` with rows
0..a-1 is `truncate`. `seen_tokens_per_row` with a tree's `rows_ancestors()`: each row saw only its own path. A
sliding-window model (tiny Mistral, window 8) runs tree passes below its window and refuses one that reaches past
it (`SpecdraftError`), leaving its cache untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from conftest import tiny_config, tiny_model
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.sampling import seen_tokens_per_row
from specdraft.tree import TreeLayout
from seeded import gen
from test_tree_layout import EXAMPLE_PARENTS


# ---------------------------------------------------------------------------------------------
# 4. Tree passes of a tiny float32 model
# ---------------------------------------------------------------------------------------------

MODEL_SEED = 7
TREE_SEED = 5
PROMPT_LEN = 6
TREE_NODES = 8
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_float_model():
    return tiny_model(tiny_config(), seed=MODEL_SEED).float()


def _random_tree(generator: torch.Generator, nodes: int, vocab: int) -> tuple[torch.Tensor, TreeLayout]:
    """Random tokens and random parents (each an earlier node or the root); at least one branch and depth 3."""
    while True:
        parents = [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(nodes)]
        layout = TreeLayout.from_parents(parents)
        if layout.width >= 2 and int(layout.depth.max()) >= 3:
            return torch.randint(0, vocab, (nodes,), generator=generator), layout


def _plain_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last row of logits of a fresh plain pass over `tokens`: `[V]`."""
    lm = CausalLM(model)
    return lm.forward(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]


@pytest.mark.parametrize("prefix", [1, 2])
def test_tree_pass_rows_equal_plain_passes_along_each_path(tiny_float_model, prefix):
    g = gen(TREE_SEED)
    vocab = tiny_float_model.config.vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=g)
    tokens, layout = _random_tree(g, TREE_NODES, vocab)
    lm = CausalLM(tiny_float_model)
    lm.prefill(prompt[:-prefix].unsqueeze(0))
    offsets, visible = layout.block_attention(prefix)
    block = torch.cat([prompt[-prefix:], tokens]).unsqueeze(0)
    logits = lm.forward(block, block.shape[1], offsets=offsets, visible=visible).logits[0]  # [prefix + n, V]
    assert lm.cache_len == PROMPT_LEN + TREE_NODES
    for j in range(prefix):  # the plain part
        expected = _plain_logits(tiny_float_model, prompt[: PROMPT_LEN - prefix + j + 1].tolist())
        torch.testing.assert_close(logits[j], expected, atol=ATOL, rtol=0)
    for node in range(TREE_NODES):
        expected = _plain_logits(tiny_float_model, prompt.tolist() + tokens[layout.path(node)].tolist())
        torch.testing.assert_close(logits[prefix + node], expected, atol=ATOL, rtol=0, msg=f"node {node}")


def test_keep_path_leaves_the_cache_of_a_plain_pass(tiny_float_model):
    """Two engine-like rounds: tree pass, keep the deepest path, then the next token and a new tree."""
    g = gen(TREE_SEED + 1)
    vocab = tiny_float_model.config.vocab_size
    sequence = torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist()
    lm = CausalLM(tiny_float_model)
    lm.prefill(torch.tensor([sequence[:-1]]))
    for _ in range(2):
        tokens, layout = _random_tree(g, TREE_NODES, vocab)
        offsets, visible = layout.block_attention(1)
        block = torch.tensor([sequence[-1:] + tokens.tolist()])
        logits = lm.forward(block, TREE_NODES + 1, offsets=offsets, visible=visible).logits[0]
        torch.testing.assert_close(logits[0], _plain_logits(tiny_float_model, sequence), atol=ATOL, rtol=0)
        path = layout.path(int(layout.depth.argmax()))  # a path that skips some rows
        assert path != list(range(len(path)))
        lm.keep(len(sequence), path)
        sequence = sequence + tokens[path].tolist()
        assert lm.cache_len == len(sequence)

        reference = CausalLM(tiny_float_model)
        reference.prefill(torch.tensor([sequence]))
        for kept, plain in zip(lm._cache.layers, reference._cache.layers):
            torch.testing.assert_close(kept.keys, plain.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(kept.values, plain.values, atol=ATOL, rtol=0)
        # the next token continues the kept path exactly as it continues the plain sequence
        next_token = int(torch.randint(0, vocab, (1,), generator=g))
        after_keep = lm.forward(torch.tensor([[next_token]])).logits[0, -1]
        sequence.append(next_token)
        torch.testing.assert_close(after_keep, _plain_logits(tiny_float_model, sequence), atol=ATOL, rtol=0)
        lm.truncate(len(sequence) - 1)  # the next round feeds the last token again, as the engine does


@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_keep_leading_rows_is_truncate(tiny_float_model, accepted):
    g = gen(TREE_SEED + 2)
    vocab = tiny_float_model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT_LEN), generator=g)
    chain = torch.randint(0, vocab, (1, 5), generator=g)
    kept, truncated = CausalLM(tiny_float_model), CausalLM(tiny_float_model)
    for lm in (kept, truncated):
        lm.prefill(prompt)
        lm.forward(chain, 1)
    kept.keep(PROMPT_LEN, list(range(accepted)))
    truncated.truncate(PROMPT_LEN + accepted)
    assert kept.cache_len == truncated.cache_len == PROMPT_LEN + accepted
    for a, b in zip(kept._cache.layers, truncated._cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    probe = torch.tensor([[1, 2]])
    assert torch.equal(kept.forward(probe, 2).logits, truncated.forward(probe, 2).logits)


# ---------------------------------------------------------------------------------------------
# 5. seen_tokens_per_row with a tree
# ---------------------------------------------------------------------------------------------


def test_seen_tokens_per_row_tree_worked_example():
    """Context {a}; the root r and the tree [b, c, d, e] shaped like tree.py's example."""
    a, r, b, c, d, e = range(6)
    layout = TreeLayout.from_parents(EXAMPLE_PARENTS)
    context = torch.zeros(6, dtype=torch.bool)
    context[a] = True
    rows = seen_tokens_per_row(context, torch.tensor([r, b, c, d, e]), layout.rows_ancestors())
    expected = [{a, r}, {a, r, b}, {a, r, c}, {a, r, b, d}, {a, r, b, e}]
    assert [set(row.nonzero().flatten().tolist()) for row in rows] == expected
    assert not context[1:].any()  # the context is not written to


def test_seen_tokens_per_row_random_tree_and_chain():
    g = gen(TREE_SEED + 3)
    vocab = 12
    tokens, layout = _random_tree(g, TREE_NODES, vocab)
    root = 11
    context = torch.rand(vocab, generator=g) < 0.3
    block = torch.cat([torch.tensor([root]), tokens])
    rows = seen_tokens_per_row(context, block, layout.rows_ancestors())
    assert rows.shape == (TREE_NODES + 1, vocab)
    for row in range(TREE_NODES + 1):
        prefix = [root] + tokens[layout.path(row - 1)].tolist()
        expected = context.clone()
        expected[prefix] = True
        assert torch.equal(rows[row], expected), f"row {row}"
    # a chain layout's rows_ancestors is the default (causal) one
    chain = TreeLayout.from_parents(list(range(-1, TREE_NODES - 1)))
    assert torch.equal(seen_tokens_per_row(context, block, chain.rows_ancestors()), seen_tokens_per_row(context, block))


# ---------------------------------------------------------------------------------------------
# 6. A sliding-window model
# ---------------------------------------------------------------------------------------------

WINDOW = 8


@pytest.fixture(scope="module")
def sliding_model():
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(MODEL_SEED)
    model = MistralForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


SLIDING_PARENTS = [-1, -1, 0]
SLIDING_TOKENS = [5, 9, 13]


def test_sliding_window_model_runs_a_tree_pass_below_its_window(sliding_model):
    prompt = [3, 1, 4, 1]  # cache 3 + block 1 + tree 3 = 7 keys < WINDOW
    layout = TreeLayout.from_parents(SLIDING_PARENTS)
    lm = CausalLM(sliding_model, name="sliding")
    lm.prefill(torch.tensor([prompt[:-1]]))
    offsets, visible = layout.block_attention(1)
    logits = lm.forward(torch.tensor([prompt[-1:] + SLIDING_TOKENS]), 4, offsets=offsets, visible=visible).logits[0]
    for node in range(-1, len(SLIDING_PARENTS)):
        path = [SLIDING_TOKENS[i] for i in layout.path(node)]
        torch.testing.assert_close(logits[node + 1], _plain_logits(sliding_model, prompt + path), atol=ATOL, rtol=0)
    lm.keep(len(prompt), layout.path(2))
    after_keep = lm.forward(torch.tensor([[7]])).logits[0, -1]
    expected = _plain_logits(sliding_model, prompt + [SLIDING_TOKENS[0], SLIDING_TOKENS[2], 7])
    torch.testing.assert_close(after_keep, expected, atol=ATOL, rtol=0)


def test_sliding_window_model_refuses_a_tree_pass_past_its_window(sliding_model):
    prompt = list(range(10, 10 + WINDOW))  # cache 7 + block 1 + tree 3 = 11 keys > WINDOW
    layout = TreeLayout.from_parents(SLIDING_PARENTS)
    lm = CausalLM(sliding_model, name="sliding")
    lm.prefill(torch.tensor([prompt[:-1]]))
    offsets, visible = layout.block_attention(1)
    with pytest.raises(SpecdraftError, match="sliding"):
        lm.forward(torch.tensor([prompt[-1:] + SLIDING_TOKENS]), 4, offsets=offsets, visible=visible)
    assert lm.cache_len == WINDOW - 1  # nothing was appended
    # a plain (chain) pass past the window still works, and matches a fresh plain pass
    logits = lm.forward(torch.tensor([prompt[-1:] + SLIDING_TOKENS]), 1).logits[0, -1]
    torch.testing.assert_close(logits, _plain_logits(sliding_model, prompt + SLIDING_TOKENS), atol=ATOL, rtol=0)
