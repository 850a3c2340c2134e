"""The AMX int4 kernel: x · (s·q − m) to float32 rounding, the same per token at any pass width,
and Int4Linear's fallback to PyTorch's kernel where AMX is missing."""

import pytest
import torch

from specdraft.kernels import int4_amx
from specdraft.models import quantize
from specdraft.models.quantize import Int4Linear

needs_amx = pytest.mark.skipif(not int4_amx.available(), reason="no AMX (or not granted) on this CPU")


def affine_matrix(n: int, k: int, seed: int = 0):
    """Random codes, scale and minimum per group of 32, and the weight they stand for with the scale and
    zero = 8·scale − minimum rounded to bf16."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.1 + 1e-3
    minimum = (torch.rand(n, k // 32, generator=g) - 0.3) * 0.5
    s = scale.bfloat16().float().repeat_interleave(32, 1)
    zero = (8 * scale - minimum).bfloat16().float().repeat_interleave(32, 1)
    weight = s * (codes.float() - 8) + zero  # [N, K]: what the kernels hold (bf16 scale and zero)
    return codes, scale, minimum, weight


@needs_amx
@pytest.mark.parametrize("tokens", [1, 2, 5, 16, 17, 40])
def test_matches_the_dequantized_weight(tokens):
    codes, scale, minimum, weight = affine_matrix(96, 256)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).bfloat16()  # [T, K]
    out = int4_amx.matmul(int4_amx.pack(codes, scale, minimum), x)  # [T, N]
    expected = x.double() @ weight.double().T
    assert out.dtype == torch.float32 and out.shape == (tokens, 96)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


@needs_amx
def test_each_token_is_computed_alone():
    """A token's output is bit-identical whether it runs alone or among 16 (verify pass == decode step)."""
    codes, scale, minimum, _ = affine_matrix(64, 128, seed=1)
    packed = int4_amx.pack(codes, scale, minimum)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    together = int4_amx.matmul(packed, x)
    for i in range(16):
        assert torch.equal(int4_amx.matmul(packed, x[i:i + 1])[0], together[i])


def test_pack_layout_and_shape_errors():
    codes, scale, minimum, _ = affine_matrix(32, 64)
    packed = int4_amx.pack(codes, scale, minimum)
    assert packed.tiles.numel() == 32 * 64 // 2 and packed.scale.shape == (2, 2, 16)
    # tile (block 0, group 0), row r = 0: pair c (codes[c, 0] low nibble, codes[c, 1] high) at 16·(c / 4) + c % 4
    first_row = packed.tiles[torch.tensor([16 * (c // 4) + c % 4 for c in range(16)])]
    assert torch.equal(first_row & 0x0F, codes[:16, 0]) and torch.equal(first_row >> 4, codes[:16, 1])
    assert not int4_amx.fits(24, 64, 32) and not int4_amx.fits(32, 96, 32) and not int4_amx.fits(32, 64, 64)
    with pytest.raises(ValueError, match="N % 16"):
        int4_amx.pack(codes[:24], scale[:24], minimum[:24])


@needs_amx
def test_int4_linear_runs_on_amx_and_agrees_with_pytorchs_kernel(monkeypatch):
    codes, scale, minimum, weight = affine_matrix(64, 128, seed=4)
    bias = torch.randn(64)
    on_amx = Int4Linear.from_affine(codes, scale, minimum, bias)
    monkeypatch.setattr(quantize.int4_amx, "available", lambda: False)
    on_torch = Int4Linear.from_affine(codes, scale, minimum, bias)
    assert on_amx.amx is not None and on_torch.amx is None
    x = torch.randn(1, 7, 128, generator=torch.Generator().manual_seed(5)).bfloat16()  # [1, T, K]
    expected = (x.float() @ weight.T + bias.bfloat16().float()).bfloat16().float()
    for module in (on_amx, on_torch):
        out = module(x)
        assert out.shape == (1, 7, 64) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(on_amx.dequantized_weight(), on_torch.dequantized_weight(), rtol=1e-2, atol=1e-2)


def test_packing_in_row_slices_changes_nothing(monkeypatch):
    codes, scale, minimum, _ = affine_matrix(96, 128, seed=6)
    whole = int4_amx.pack(codes, scale, minimum)
    monkeypatch.setattr(int4_amx, "_PACK_ROWS", 32)
    sliced = int4_amx.pack(codes, scale, minimum)
    for name in ("tiles", "scale", "zero"):
        assert torch.equal(getattr(whole, name), getattr(sliced, name))
