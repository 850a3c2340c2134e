"""The fused Triton kernels of the GPU path, run on the CPU under Triton's interpreter: each against the torch
formula it replaces, and a static pass on them against transformers' forward and plain decoding.

Skipped where Triton is not installed (it comes with CUDA builds of torch; `pip install triton` on a CPU
machine). On a GPU the device check runs the same kernels compiled (`specdraft.bench.device_check`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import perturbed, tiny_config, tiny_model
from specdraft.drafters import ModelDrafter
from specdraft.engine import SpeculativeDecoder
from specdraft.models import fused_kernels
from specdraft.models.causal_lm import CausalLM
from specdraft.tree import TreeLayout

pytest.importorskip("triton")

ATOL = 2e-5


if not fused_kernels.interpreted():
    pytest.skip("Triton's interpreter is off (conftest turns it on where CUDA is absent)", allow_module_level=True)


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    """Static passes on the CPU take the fused kernels (as numpy, through Triton's interpreter)."""
    monkeypatch.setenv("SPECDRAFT_FUSED_KERNELS", "1")


def wide_heads_model(seed: int):
    """A tiny Qwen2 with 16-wide heads (the least the kernels take): 4 query heads over 2 key/value heads."""
    config = tiny_config(max_positions=1024)
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 96, 16
    return tiny_model(config, seed)


def test_rotation_and_cache_write_match_the_torch_formula():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, d, width = 4, 2, 16, 3
    qkv = torch.randn(width, heads + 2 * kv_heads, d, generator=generator)
    cos, sin = torch.randn(2, width, d, generator=generator)
    states = torch.zeros(10, 2, kv_heads, d)
    slots = torch.tensor([7, 2, 5])
    expected_qkv = qkv.clone()
    rotated = qkv[:, : heads + kv_heads] * cos[:, None] + torch.cat(
        (-qkv[:, : heads + kv_heads, d // 2 :], qkv[:, : heads + kv_heads, : d // 2]), dim=-1) * sin[:, None]
    expected_qkv[:, :heads] = rotated[:, :heads]
    fused_kernels.rotate_and_store(qkv, cos, sin, slots, states, heads, kv_heads)
    torch.testing.assert_close(qkv[:, :heads], expected_qkv[:, :heads], atol=1e-6, rtol=0)
    torch.testing.assert_close(qkv[:, heads:], expected_qkv[:, heads:], atol=0, rtol=0)  # k and v left as they were
    torch.testing.assert_close(states[slots, 0], rotated[:, heads:], atol=1e-6, rtol=0)
    torch.testing.assert_close(states[slots, 1], qkv[:, heads + kv_heads :], atol=0, rtol=0)
    untouched = [s for s in range(10) if s not in slots.tolist()]
    assert states[untouched].abs().sum() == 0


@pytest.mark.parametrize("width, keys", [(1, 40), (3, 300), (16, 129), (9, 64), (1, 4200)])
def test_split_attention_matches_the_eager_formula(width, keys):
    """Over several key splits (the last one partial, some wholly masked for some rows; past 32 splits wider ones,
    the last ones empty), grouped query heads."""
    generator = torch.Generator().manual_seed(width)
    heads, kv_heads, d = 6, 2, 16
    qkv = torch.randn(width, heads + 2 * kv_heads, d, generator=generator)
    states = torch.randn(keys + 5, 2, kv_heads, d, generator=generator)
    allowed = torch.rand(width, keys, generator=generator) < 0.5
    allowed[:, 0] = True  # every row sees the first key, as every real and padding row does
    allowed[0, 100:] = False  # a row that sees nothing past 100 keys: its later splits are empty
    closed = torch.finfo(torch.float32).min
    mask = torch.where(allowed, 0.0, closed)
    got = fused_kernels.attend(qkv, states, keys, mask, heads, scaling=0.25)
    q = qkv[:, :heads].reshape(width, kv_heads, heads // kv_heads, d)  # [W, kv, g, d]
    k, v = states[:keys, 0], states[:keys, 1]  # [keys, kv, d]
    scores = torch.einsum("tkgd,jkd->tkgj", q, k) * 0.25 + mask[:, None, None, :]
    expected = torch.einsum("tkgj,jkd->tkgd", scores.softmax(-1), v).reshape(width, heads * d)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_silu_times_up_matches_the_torch_formula():
    gate_up = torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(1))  # two column blocks, one partial
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # whole passes under Triton's interpreter: about 25 s on 2 cores without CUDA
def test_a_static_pass_on_fused_kernels_matches_the_dynamic_cache():
    """Chains of bucketed and odd widths, a rollback, a tree pass and its kept path: transformers' logits."""
    model = wide_heads_model(seed=3)
    dynamic, static = CausalLM(model, static_cache=False), CausalLM(model, static_cache=True)
    assert static._static.fused and static._static.fused_mlp
    generator = torch.Generator().manual_seed(0)

    def both(*args, **kwargs):
        outs = [lm.forward(*args, **kwargs) for lm in (dynamic, static)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=ATOL, rtol=0)

    both(torch.randint(0, 64, (1, 140), generator=generator), logits_to_keep=140)
    for width in (1, 3, 8, 17):
        both(torch.randint(0, 64, (1, width), generator=generator), logits_to_keep=width)
        for lm in (dynamic, static):
            lm.truncate(lm.cache_len - width // 2)
    layout = TreeLayout.from_parents([-1, -1, 0, 0, 1, 2])
    offsets, visible = layout.block_attention(1)
    start = static.cache_len
    both(torch.randint(0, 64, (1, 7), generator=generator), 7, offsets=offsets, visible=visible)
    for lm in (dynamic, static):
        lm.keep(start, [0, 1, 3, 6])
    both(torch.randint(0, 64, (1, 2), generator=generator), logits_to_keep=2)


@pytest.mark.slow
def test_greedy_speculation_on_fused_kernels_equals_plain_decoding():
    target_model = wide_heads_model(seed=4)
    target = CausalLM(target_model, static_cache=True)
    draft = CausalLM(perturbed(target_model, noise=0.3, seed=1), static_cache=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = SpeculativeDecoder(CausalLM(target_model, static_cache=False)).generate(prompt, max_new_tokens=12)
    got = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), k=3, tree_budget=6)
    assert got.generate(prompt, max_new_tokens=12).token_ids == expected.token_ids


@pytest.mark.slow  # under Triton's interpreter: about 85 s on 2 cores; batches on the static cache's torch formulas
def test_a_batch_on_fused_kernels_answers_as_alone(monkeypatch):  # run in the quick set (test_batch_engine)
    """A packed batch on the static cache through the fused kernels (the GPU's path): three requests at once, a
    draft model each in one packed static draft cache, every answer its answer alone."""
    from specdraft.batch_engine import BatchedDecoder, BatchRequest
    from specdraft.sampling import SamplingParams

    monkeypatch.setenv("SPECDRAFT_STATIC_CACHE", "1")  # the packed draft cache takes the static one too
    target_model = wide_heads_model(seed=4)
    draft_model = perturbed(target_model, noise=0.3, seed=1)
    target = CausalLM(target_model)
    assert target._static.fused
    prompts, greedy = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3]], SamplingParams(temperature=0.0)
    expected = [SpeculativeDecoder(target, ModelDrafter(CausalLM(draft_model), min_confidence=0.0), k=3).generate(
        p, greedy, max_new_tokens=12).token_ids for p in prompts]
    batch = BatchedDecoder(target, lambda: ModelDrafter(CausalLM(draft_model, static_cache=False), min_confidence=0.0))
    got = batch.generate_all([BatchRequest(p, greedy, 12, k=3) for p in prompts])
    assert [c.token_ids for c in got] == expected and batch.largest_batch == 3
    assert sum(c.stats.drafted for c in got) > 0
