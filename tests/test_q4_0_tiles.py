"""Q4_0 tiles (`kernels/q4_0_tiles.py`, each library's `q4k_tiles.h`, format `TILES_Q4_0`): a file's Q4_0 blocks
as stored (codes and fp16 d), times each token's activations on one int8 scale per 256 inputs; each test on every level
this CPU runs (`SPECDRAFT_ISA`)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from specdraft.kernels import numerics, prompt_pass, q4_0_tiles
from specdraft.models.gguf_blocks import q4_0_stored
from conftest import stored_levels
from test_gguf_native import gguf_values

LEVELS = stored_levels()
pytestmark = pytest.mark.skipif(not LEVELS, reason="neither the AVX2 nor the AVX-512 kernels run on this CPU")
Q4_0 = GGMLQuantizationType.Q4_0


@pytest.fixture
def level(stored_level) -> str:
    """Each level with Q4_0 tiles that this CPU runs, forced."""
    assert q4_0_tiles.available()
    return stored_level


def random_q4_0(rows: int, inputs: int, seed: int) -> np.ndarray:
    """gguf's Q4_0 blocks `[rows, inputs / 32 · 18]` of normal weights."""
    return gguf_quantize(np.random.default_rng(seed).normal(0, 0.05, (rows, inputs)).astype(np.float32), Q4_0)


def rows_of(raw: np.ndarray):
    return lambda start, stop: q4_0_stored(torch.from_numpy(raw[start:stop]))


def case(rows: int, inputs: int, tokens: int, seed: int = 0):
    """Packed tiles of a random Q4_0 matrix, its raw bytes, gguf's float32 values of it `[N, K]`, and bf16 inputs
    `[T, K]` (a few channels 50 times the rest, as real activations have)."""
    raw = random_q4_0(rows, inputs, seed)
    packed = q4_0_tiles.pack_q4_0(rows_of(raw), rows, inputs)
    x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(seed))  # [T, K]
    x[:, 7::97] *= 50
    return packed, raw, gguf_values(raw, Q4_0), x.bfloat16()


def int8_reference(raw: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """The kernel's function in float64: â = round(x · 127 / max|x|) per 256 inputs (ties to even), a = max|x| / 127,
    then Σ_g d·a·(Σ q·â − 8·Σâ) per group of 32; `[T, N]`."""
    codes, d = q4_0_stored(torch.from_numpy(raw))  # [N, K], [N, K/32]
    rows, inputs = codes.shape
    xs = x.float().view(x.shape[0], -1, 256)  # [T, S, 256]
    amax = xs.abs().amax(-1, keepdim=True)  # [T, S, 1]
    a = (amax / 127).double().repeat_interleave(8, dim=1).squeeze(-1)  # [T, K/32]: float32 as in the kernel
    groups = torch.round(xs * (127 / amax)).double().view(x.shape[0], -1, 32)  # [T, K/32, 32]
    dots = torch.einsum("tgi,ngi->tng", groups, codes.double().view(rows, -1, 32)) - 8 * groups.sum(-1)[:, None]
    return (d.double()[None] * a[:, None] * dots).sum(-1)  # [T, N]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("rows, inputs, tokens", [(48, 512, 1), (48, 512, 3), (48, 512, 7), (16, 4096, 70)])
def test_q4_0_tiles_compute_the_int8_function_of_the_files_weights(level, rows, inputs, tokens):
    """In an int8 pass, x · W on int8 activations per 256 inputs: the float64 model of that function within float32
    rounding (a step or a code out of place is off by far more), and gguf's own values of the weights within the
    activations' 8 bits; out of one, the exact path within 1e-4 of gguf's values; on a pass of one token, of a few,
    and of more than one sweep over the rows takes (4,096 inputs: 64)."""
    packed, raw, weight, x = case(rows, inputs, tokens)
    with prompt_pass.prompt_pass():
        got = q4_0_tiles.q4_0_matmul(packed, x)  # [T, N]
    assert got.shape == (tokens, rows) and got.dtype == torch.float32
    assert relative_error(got, int8_reference(raw, x)) < 1e-6
    assert relative_error(got, x.double() @ weight.double().T) < 0.05
    assert relative_error(q4_0_tiles.q4_0_matmul(packed, x), x.double() @ weight.double().T) < 1e-4


def test_q4_0_tiles_compute_each_token_alone(level):
    """A token's outputs have the same bits in any pass width, on either path, and across the sweeps of a long pass,
    so a verify pass agrees with one-token decoding; a pass that starts a sequence keeps its first token on the
    exact path and the rest on int8 activations."""
    packed, _, _, x = case(32, 4096, 70, seed=1)
    exact = q4_0_tiles.q4_0_matmul(packed, x)  # [70, N], the exact path
    with prompt_pass.prompt_pass():
        together = q4_0_tiles.q4_0_matmul(packed, x)  # [70, N], int8 activations
        for i in (0, 31, 63, 64, 69):
            assert torch.equal(q4_0_tiles.q4_0_matmul(packed, x[i:i + 1])[0], together[i])
        for width in range(2, 12):
            assert torch.equal(q4_0_tiles.q4_0_matmul(packed, x[30:30 + width]), together[30:30 + width]), width
    for width in (1, 3, 4, 5, 9):
        assert torch.equal(q4_0_tiles.q4_0_matmul(packed, x[30:30 + width]), exact[30:30 + width]), width
    assert not torch.equal(exact[3], together[3])
    with prompt_pass.prompt_pass(starts_sequence=True):
        assert torch.equal(q4_0_tiles.q4_0_matmul(packed, x[3:9]), torch.cat([exact[3:4], together[4:9]]))


def test_q4_0_linear_keeps_the_files_blocks_and_adds_its_bias(level):
    """`Q40Linear`: the file's codes and fp16 d (4.5 bits a weight, the file's own), nothing rounded; its bias added in
    float32."""
    raw = random_q4_0(32, 512, seed=2)
    bias = torch.randn(32)
    linear = q4_0_tiles.Q40Linear(rows_of(raw), 32, 512, bias)
    stored = sum(buffer.numel() * buffer.element_size() for buffer in linear.buffers() if buffer is not linear.bias)
    assert stored * 8 / (32 * 512) == 4.5
    d = q4_0_stored(torch.from_numpy(raw))[1]  # [32, 16] float16
    assert torch.equal(linear.packed.steps[1].view(torch.float16), d[16:].T)  # block 1: rows 16-31, [group, row]
    x = torch.randn(5, 512).bfloat16()
    with prompt_pass.prompt_pass():
        assert torch.equal(linear(x.float()), (q4_0_tiles.q4_0_matmul(linear.packed, x) + bias).float())


@pytest.mark.skipif(len(LEVELS) < 2, reason="needs both the AVX2 and the AVX-512 kernels")
def test_q4_0_tiles_give_the_same_bits_on_avx2_and_avx512(monkeypatch):
    """On int8 activations both levels compute one function in one order (the same â, exact integer sums, the same
    float32 step per group), so a model's outputs do not depend on which of them runs; against the exact weights
    each is within 1e-4 of gguf's values (AVX2 rounds activations to int16, AVX-512 keeps float32)."""
    packed, _, weight, x = case(64, 1024, 11, seed=3)
    got = {}
    for name in LEVELS:
        monkeypatch.setenv(numerics.ISA_VARIABLE, name)
        with prompt_pass.prompt_pass():
            got[name] = q4_0_tiles.q4_0_matmul(packed, x)  # [11, 64]
        exact = q4_0_tiles.q4_0_matmul(packed, x)
        assert relative_error(exact, x.double() @ weight.double().T) < 1e-4, name
    assert torch.equal(got["avx2"], got["avx512"])


@pytest.mark.parametrize("shape", [(24, 512), (32, 288), (16, 1152)])
def test_q4_0_tiles_refuse_shapes_they_cannot_hold(shape):
    """Rows come 16 to a tile and inputs in whole blocks of 256 (Q4_K's int8 activations): anything else is refused,
    naming the rule (Gemma's 1,152-wide rows stay on the 4-bit tiles)."""
    assert not q4_0_tiles.fits(*shape)
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 256 == 0"):
        q4_0_tiles.pack_q4_0(lambda start, stop: None, *shape)
