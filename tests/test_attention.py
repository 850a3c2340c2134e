"""Few-query attention (decoding, verification and tree passes over a cache) equals softmax(q kᵀ) v
with grouped key/value heads, for every mask form transformers and the tree passes hand it."""

import pytest
import torch

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
