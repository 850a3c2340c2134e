"""Few-query attention (decoding, verification and tree passes over a cache) equals softmax(q kᵀ) v
with grouped key/value heads, for every mask form transformers and the tree passes hand it."""

import pytest
import torch

from specdraft.kernels import cache_attention
from specdraft.models.attention import few_query_attention


def reference(query, key, value, allowed, scaling):  # float64, key/value heads repeated per group
    groups = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(groups, dim=1)
    value = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ key.transpose(-1, -2) * scaling  # [B, H, T, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)  # [B, T, H, D]


@pytest.mark.parametrize("length, keys, mask_form", [(1, 37, "none"), (5, 40, "bool"), (6, 30, "additive")])
def test_few_query_attention_matches_the_definition(length, keys, mask_form):
    g = torch.Generator().manual_seed(length)
    query = torch.randn(1, 6, length, 16, generator=g).bfloat16()  # 6 query heads share 2 kv heads
    key = torch.randn(1, 2, keys, 16, generator=g).bfloat16()
    value = torch.randn(1, 2, keys, 16, generator=g).bfloat16()
    allowed = torch.ones(length, keys, dtype=torch.bool)
    if mask_form == "bool":  # causal, bottom-right aligned (a chain verify pass)
        allowed = torch.arange(keys) <= torch.arange(keys - length, keys).unsqueeze(1)
    elif mask_form == "additive":  # a tree pass: some drafted tokens hidden from others
        allowed[:, keys - length:] = torch.rand(length, length, generator=g) < 0.5
        allowed[:, keys - length:] |= torch.eye(length, dtype=torch.bool)
    mask = {"none": None, "bool": allowed.view(1, 1, length, keys),
            "additive": torch.zeros(1, 1, length, keys, dtype=torch.bfloat16).masked_fill(
                ~allowed, torch.finfo(torch.bfloat16).min)}[mask_form]
    out = few_query_attention(query, key, value, mask, scaling=0.25)
    assert out.shape == (1, length, 6, 16) and out.dtype == torch.bfloat16 and out.is_contiguous()
    want = reference(query, key, value, allowed.view(1, 1, length, keys), 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_a_fully_hidden_row_stays_finite():
    """A query that may see no key (a left-padded row of a batch) gives finite output, not NaN."""
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 3, 8, generator=g).bfloat16() for _ in range(3))
    key, value = key[:, :2], value[:, :2]  # [B, 2, S=3, 8]
    allowed = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    allowed[1, 0, 0] = False  # batch row 1, query 0: nothing visible
    out = few_query_attention(query, key, value, allowed, scaling=0.3)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out[0].double(), reference(query[:1], key[:1], value[:1], allowed[:1], 0.3)[0],
                               rtol=1e-2, atol=1e-2)


kernel_runs = pytest.mark.skipif(not cache_attention.available(), reason="no native attention kernel here")


def random_states(length, keys, dim, seed, heads=12, kv_heads=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, length, dim, generator=g).bfloat16(),
            torch.randn(1, kv_heads, keys, dim, generator=g).bfloat16(),
            torch.randn(1, kv_heads, keys, dim, generator=g).bfloat16())


@kernel_runs
@pytest.mark.parametrize("length, keys, dim, mask_form", [(1, 300, 128, "none"), (5, 77, 64, "bool"),
                                                          (8, 1000, 128, "additive"), (3, 17, 32, "bool")])
def test_attention_kernel_matches_the_definition(length, keys, dim, mask_form):
    query, key, value = random_states(length, keys, dim, seed=length)
    allowed = torch.ones(length, keys, dtype=torch.bool)
    if mask_form != "none":
        allowed = torch.arange(keys) <= torch.arange(keys - length, keys).unsqueeze(1)
    mask = {"none": None, "bool": allowed.view(1, 1, length, keys),
            "additive": torch.zeros(1, 1, length, keys, dtype=torch.bfloat16).masked_fill(
                ~allowed, torch.finfo(torch.bfloat16).min)}[mask_form]
    assert cache_attention.supports(query, key, value)
    out = cache_attention.attend(query, key, value, mask, dim ** -0.5)
    assert out.shape == (1, length, 12, dim) and out.dtype == torch.bfloat16
    want = reference(query, key, value, allowed.view(1, 1, length, keys), dim ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)  # bf16 output rounding


@kernel_runs
def test_attention_kernel_gives_each_query_the_same_bits_in_any_pass():
    """A verify pass's queries equal one-token passes bit for bit (so verification agrees with decoding)."""
    query, key, value = random_states(6, 50, 128, seed=3)
    causal = (torch.arange(50) <= torch.arange(44, 50).unsqueeze(1)).view(1, 1, 6, 50)
    together = cache_attention.attend(query, key, value, causal, 0.1)  # [1, 6, 12, 128]
    for t in range(6):
        alone = cache_attention.attend(query[:, :, t:t + 1], key[:, :, :45 + t], value[:, :, :45 + t], None, 0.1)
        assert torch.equal(alone[:, 0], together[:, t])


@kernel_runs
@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 2, 128), (14, 2, 64), (8, 1, 32), (4, 4, 64)])
def test_query_heads_taken_together_get_the_bits_each_gets_alone(heads, kv_heads, dim):
    """The heads that share a key/value head may be computed together (the AVX2 kernel converts each key and value
    row once for up to 4 of them: 6 = 3 + 3, 7 = 4 + 3, 8 = 4 + 4): each head gets what it gets alone, bit for bit."""
    query, key, value = random_states(3, 41, dim, seed=heads, heads=heads, kv_heads=kv_heads)
    causal = (torch.arange(41) <= torch.arange(38, 41).unsqueeze(1)).view(1, 1, 3, 41)
    together = cache_attention.attend(query, key, value, causal, 0.1)  # [1, 3, heads, dim]
    for h in range(heads):
        kv = h // (heads // kv_heads)
        alone = cache_attention.attend(query[:, h:h + 1], key[:, kv:kv + 1], value[:, kv:kv + 1], causal, 0.1)
        assert torch.equal(alone[:, :, 0], together[:, :, h]), h


@kernel_runs
@pytest.mark.parametrize("hidden", [float("-inf"), torch.finfo(torch.float32).min], ids=["-inf", "float-min"])
def test_a_tree_node_gets_the_bits_of_the_same_token_decoded_after_its_ancestors(hidden):
    """A tree node sees the cache and its ancestors, with hidden siblings between them: it gets the bits of a
    one-token pass over exactly those keys (hidden keys must not shift the others' vector lanes: summed as
    zeros in place, 3 of these 40 cases parted from the chain in the last bit, and so did greedy outputs of
    the bundled pair with trees)."""
    for seed in range(10):
        query, key, value = random_states(4, 60, 128, seed=seed)
        seen = torch.ones(60, dtype=torch.bool)
        seen[47:] = torch.rand(13, generator=torch.Generator().manual_seed(seed)) < 0.5  # the tree part
        seen[59] = True  # the node itself
        mask = torch.zeros(1, 1, 1, 60).masked_fill(~seen, hidden)
        for t in range(4):
            in_tree = cache_attention.attend(query[:, :, t:t + 1], key, value, mask, 0.1)
            as_chain = cache_attention.attend(query[:, :, t:t + 1], key[:, :, seen], value[:, :, seen], None, 0.1)
            assert torch.equal(in_tree, as_chain), (seed, t)


@kernel_runs
def test_attention_kernel_reads_a_cache_cut_back_in_place():
    """Keys and values that are views of a larger buffer (a cache with spare room) give the same result."""
    query, key, value = random_states(2, 40, 64, seed=4)
    buffer_k, buffer_v = torch.randn(1, 2, 70, 64).bfloat16(), torch.randn(1, 2, 70, 64).bfloat16()
    buffer_k[:, :, :40], buffer_v[:, :, :40] = key, value
    assert torch.equal(cache_attention.attend(query, buffer_k[:, :, :40], buffer_v[:, :, :40], None, 0.2),
                       cache_attention.attend(query, key, value, None, 0.2))


@kernel_runs
def test_attention_kernel_fully_hidden_row_averages_the_values():
    """Like the PyTorch path: a row that sees nothing gets uniform weights, finite output."""
    query, key, value = random_states(2, 5, 32, seed=5, heads=4, kv_heads=2)
    allowed = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    allowed[0, 0, 1] = True
    out = cache_attention.attend(query, key, value, allowed, 1.0)
    assert torch.isfinite(out.float()).all()
    mean = value.double().mean(dim=2).repeat_interleave(2, dim=1)  # [1, 4, 32]
    torch.testing.assert_close(out[0, 0].double(), mean[0], rtol=1e-2, atol=1e-2)


@kernel_runs
def test_few_query_attention_takes_the_kernel_for_bf16_batches_of_one():
    query, key, value = random_states(1, 30, 64, seed=6)
    assert torch.equal(few_query_attention(query, key, value, None, 0.125),
                       cache_attention.attend(query, key, value, None, 0.125))
    batch = [torch.cat([s, s]) for s in (query, key, value)]  # batch 2: PyTorch's path
    assert not cache_attention.supports(*batch)


@pytest.mark.parametrize("level", ["torch", "avx2", "avx512"])
@pytest.mark.parametrize("mask_form", ["none", "additive"])
def test_soft_capped_scores_match_the_definition(level, mask_form, monkeypatch):
    """Gemma 2's soft-capped scores, `cap · tanh(q kᵀ · scaling / cap)` before the mask, on each level's attention
    (`SPECDRAFT_ISA`: PyTorch's, the AVX2 and the AVX-512 kernels); the cap is small enough to change the output."""
    from specdraft.kernels import isa, numerics

    if not isa.CPU_FLAGS[level] <= isa.cpu_flags():
        pytest.skip(f"this CPU has no {level}")
    monkeypatch.setenv(numerics.ISA_VARIABLE, level)
    length, keys, dim, cap = 5, 77, 64, 2.0
    query, key, value = random_states(length, keys, dim, seed=3)  # scores of about ±1 at scaling 1 / 8
    allowed = torch.ones(length, keys, dtype=torch.bool)
    mask = None
    if mask_form == "additive":  # a tree pass's: some keys hidden
        allowed = torch.rand(length, keys, generator=torch.Generator().manual_seed(4)) < 0.7
        mask = torch.zeros(1, 1, length, keys, dtype=torch.bfloat16).masked_fill(
            ~allowed, torch.finfo(torch.bfloat16).min)
    assert cache_attention.supports(query, key, value) == (level != "torch")
    out = few_query_attention(query, key, value, mask, dim ** -0.5, softcap=cap)  # [1, T, heads, d]
    groups = query.shape[1] // key.shape[1]
    scores = query.double() @ key.double().repeat_interleave(groups, dim=1).transpose(-1, -2) * dim ** -0.5
    capped = (cap * torch.tanh(scores / cap)).masked_fill(~allowed, float("-inf"))  # [1, heads, T, S]
    want = (capped.softmax(-1) @ value.double().repeat_interleave(groups, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    uncapped = few_query_attention(query, key, value, mask, dim ** -0.5)
    assert (uncapped.double() - want).abs().max() > 0.05


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_weights_below_the_least_normal_float_count_zero(level, monkeypatch):
    """A key scored more than 87 below the row's best would get a subnormal weight (slow in every multiply-add that
    reads it); the kernels count it zero (`shared/normal_exp.h`). Its value row is so large (3e38) that a weight of
    exp(-88) = 6e-39 would add about 1.8 to an output that is otherwise 0; one of exp(-86) = 4e-38 (normal) still
    counts."""
    from specdraft.kernels import isa, numerics

    if not isa.CPU_FLAGS[level] <= isa.cpu_flags():
        pytest.skip(f"this CPU has no {level}")
    monkeypatch.setenv(numerics.ISA_VARIABLE, level)
    dim = 32
    query = torch.zeros(1, 1, 1, dim, dtype=torch.bfloat16)
    query[..., 0] = 1.0
    value = torch.zeros(1, 1, 2, dim, dtype=torch.bfloat16)
    value[0, 0, 1] = 3e38  # the low-scored key's row
    for gap, counts in ((88.0, False), (86.0, True)):
        key = torch.zeros(1, 1, 2, dim, dtype=torch.bfloat16)
        key[0, 0, 0, 0] = gap  # the best key; the other scores 0: `gap` below it
        out = cache_attention.attend(query, key, value, None, 1.0)[0, 0, 0].float()  # [d]
        weight = torch.tensor(-gap).exp().item()
        assert torch.isfinite(out).all()
        if counts:
            torch.testing.assert_close(out, torch.full((dim,), weight * 3e38), rtol=2e-2, atol=0.0)
        else:
            assert torch.equal(out, torch.zeros(dim))
