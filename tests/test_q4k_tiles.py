"""Q4_K tiles (`kernels/q4k_tiles.py`, `native/avx2/q4k_tiles.h`, `native/avx512/q4k_tiles.h`):
a file's Q4_K, Q5_K, Q4_0 and Q5_0 blocks as stored, times each token's activations on one int8 scale per 256 inputs
(the K-quants: their scales and mins applied as integers, llama.cpp's Q8_K numerics) or per 32 (Q4_0, Q5_0: each group's
d, llama.cpp's Q8_0); each test on every level this CPU runs (`SPECDRAFT_ISA`), for each type."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from specdraft.kernels import numerics, prompt_pass, q4k_tiles
from specdraft.models.gguf_blocks import q4_0_stored, q4k_stored
from conftest import stored_levels
from test_gguf_native import gguf_values, random_q4k, random_q5k

LEVELS = stored_levels()
pytestmark = pytest.mark.skipif(not LEVELS, reason="neither the AVX2 nor the AVX-512 kernels run on this CPU")


@pytest.fixture
def level(stored_level) -> str:
    """Each level with Q4_K tiles that this CPU runs, forced."""
    assert q4k_tiles.available()
    return stored_level


PER_GROUP = ("Q4_0", "Q5_0")  # the types with a step per group of 32 (`q4k_tiles.Q40Linear`)


@pytest.fixture(params=["Q4_K", "Q5_K", *PER_GROUP])
def kind(request) -> str:
    """Each type the tiles hold."""
    return request.param


def random_raw(kind: str, rows: int, inputs: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind in PER_GROUP:  # gguf's quantizer, of normal weights
        return gguf_quantize(rng.normal(0, 0.05, (rows, inputs)).astype(np.float32), GGMLQuantizationType[kind])
    return random_q4k(rows, inputs // 256, rng) if kind == "Q4_K" else random_q5k(rows, inputs // 256, rng)


def rows_of(raw: np.ndarray, kind: str):
    stored = q4_0_stored if kind in PER_GROUP else q4k_stored
    return lambda start, stop: stored(torch.from_numpy(raw[start:stop]), kind)


def pack(raw: np.ndarray, kind: str, rows: int, inputs: int):
    if kind in PER_GROUP:
        return q4k_tiles.pack_q4_0(rows_of(raw, kind), rows, inputs, kind)
    return q4k_tiles.pack_q4k(rows_of(raw, kind), rows, inputs, kind)


def matmul(packed, x: torch.Tensor) -> torch.Tensor:
    """The kernel of `packed`'s tiles: `q4_0_matmul` or `q4k_matmul`."""
    return (q4k_tiles.q4_0_matmul if isinstance(packed, q4k_tiles.PackedQ40) else q4k_tiles.q4k_matmul)(packed, x)


def case(rows: int, inputs: int, tokens: int, seed: int = 0, kind: str = "Q4_K"):
    """Packed tiles of a random matrix of `kind`, its raw bytes, gguf's float32 values of it `[N, K]`, and bf16
    inputs `[T, K]` (a few channels 50 times the rest, as real activations have)."""
    raw = random_raw(kind, rows, inputs, seed)
    x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(seed))  # [T, K]
    x[:, 7::97] *= 50
    return pack(raw, kind, rows, inputs), raw, gguf_values(raw, GGMLQuantizationType[kind]), x.bfloat16()


def int8_reference(raw: np.ndarray, x: torch.Tensor, kind: str = "Q4_K") -> torch.Tensor:
    """The kernel's function in float64: â = round(x · 127 / max|x|) per 256 inputs (ties to even), a = max|x| / 127,
    then d·a·Σ sc·Σ q·â − dmin·a·Σ m·Σ â per super-block (Q4_0, Q5_0: per 32 inputs, Σ_g d·a·(Σ q·â − 2^(b−1)·Σâ));
    `[T, N]`."""
    xs = x.float().view(x.shape[0], -1, 32 if kind in PER_GROUP else 256)  # [T, S, 32 or 256]
    amax = xs.abs().amax(-1, keepdim=True)  # [T, S, 1]
    a = (amax / 127).double()  # float32 as in the kernel, as are the factor and the product below
    # 127 / max|x| correctly rounded to float32, as the kernel's division is (PyTorch's scalar / tensor is not: it
    # multiplies by a reciprocal, and a product that lands on .5 then rounds the other way)
    xq = torch.round(xs * (127 / amax.double()).float()).double()  # [T, S, 32 or 256]
    groups = xq.view(x.shape[0], -1, 32)  # [T, K/32, 32]
    if kind in PER_GROUP:
        codes, d = q4_0_stored(torch.from_numpy(raw), kind)  # [N, K], [N, K/32]
        dots = torch.einsum("tgi,ngi->tng", groups, codes.double().view(codes.shape[0], -1, 32))  # [T, N, K/32]
        middle = 16 if kind == "Q5_0" else 8
        return (d.double() * a.squeeze(-1)[:, None] * (dots - middle * groups.sum(-1)[:, None])).sum(-1)  # [T, N]
    codes, d, dmin, sc, mn = q4k_stored(torch.from_numpy(raw), kind)  # [N, K], [N, K/256] x 2, [N, K/32] x 2
    rows, inputs = codes.shape
    dots = torch.einsum("tgi,ngi->tng", groups, codes.double().view(rows, -1, 32))  # [T, N, K/32]
    per_super = (dots * sc.double()).view(x.shape[0], rows, -1, 8).sum(-1)  # [T, N, S]
    mins = (groups.sum(-1)[:, None] * mn.double()).view(x.shape[0], rows, -1, 8).sum(-1)  # [T, N, S]
    scale = a.squeeze(-1)[:, None]  # [T, 1, S]
    return (d.double() * scale * per_super - dmin.double() * scale * mins).sum(-1)  # [T, N]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("rows, inputs, tokens", [(48, 512, 1), (48, 512, 3), (48, 512, 7), (16, 4096, 70)])
def test_q4k_tiles_compute_llama_cpps_function_of_the_files_weights(level, kind, rows, inputs, tokens):
    """In an int8 pass, x · W on int8 activations per 256 inputs: the float64 model of that function within float32
    rounding (a scale, a min or a code out of place is off by far more), and gguf's own values of the weights within
    the activations' 8 bits; out of one, the 16-bit path within 1e-4 of gguf's values; on a pass of one token, of a
    few, and of more than one sweep over the rows takes (4,096 inputs: 64)."""
    packed, raw, weight, x = case(rows, inputs, tokens, kind=kind)
    with prompt_pass.prompt_pass():
        got = matmul(packed, x)  # [T, N]
    assert got.shape == (tokens, rows) and got.dtype == torch.float32
    assert relative_error(got, int8_reference(raw, x, kind)) < 1e-6
    assert relative_error(got, x.double() @ weight.double().T) < 0.05  # 3.2% at most here, with the 50x channels
    assert relative_error(matmul(packed, x), x.double() @ weight.double().T) < 1e-4


def test_q4k_tiles_compute_each_token_alone(level, kind):
    """A token's outputs have the same bits in any pass width, on either path, and across the sweeps of a long pass,
    so a verify pass agrees with one-token decoding; a pass that starts a sequence keeps its first token on the
    16-bit path and the rest on int8 activations."""
    packed, _, _, x = case(32, 4096, 70, seed=1, kind=kind)
    exact = matmul(packed, x)  # [70, N], the 16-bit path
    with prompt_pass.prompt_pass():
        together = matmul(packed, x)  # [70, N], int8 activations
        for i in (0, 31, 63, 64, 69):
            assert torch.equal(matmul(packed, x[i:i + 1])[0], together[i])
        for width in range(2, 12):
            assert torch.equal(matmul(packed, x[30:30 + width]), together[30:30 + width]), width
    for width in (1, 3, 4, 5, 9):
        assert torch.equal(matmul(packed, x[30:30 + width]), exact[30:30 + width]), width
    assert not torch.equal(exact[3], together[3])
    with prompt_pass.prompt_pass(starts_sequence=True):
        assert torch.equal(matmul(packed, x[3:9]), torch.cat([exact[3:4], together[4:9]]))


def test_q4k_linear_keeps_the_files_blocks_and_adds_its_bias(level):
    """`Q4KLinear`: the file's codes, 6-bit scales and mins and fp16 d and dmin (4.625 bits a weight), nothing rounded;
    its bias added in float32."""
    raw = random_q4k(32, 2, np.random.default_rng(2))
    bias = torch.randn(32)
    linear = q4k_tiles.Q4KLinear(lambda start, stop: q4k_stored(torch.from_numpy(raw[start:stop])), 32, 512, bias)
    stored = sum(buffer.numel() * buffer.element_size() for buffer in linear.buffers())
    assert stored * 8 / (32 * 512) == 4.625
    d = q4k_stored(torch.from_numpy(raw))[1]  # [32, 2] float16
    assert torch.equal(linear.packed.steps[0, :, :16].view(torch.float16), d[:16].T)
    x = torch.randn(5, 512).bfloat16()
    with prompt_pass.prompt_pass():
        assert torch.equal(linear(x.float()), (matmul(linear.packed, x) + bias).float())


@pytest.mark.skipif(len(LEVELS) < 2, reason="needs both the AVX2 and the AVX-512 kernels")
def test_q4k_tiles_give_the_same_bits_on_avx2_and_avx512(monkeypatch, kind):
    """On int8 activations both levels compute one function in one order (the same â, exact integer sums, the same
    float32 steps per super-block), so a model's outputs do not depend on which of them runs; against the exact
    weights each is within 1e-4 of gguf's values (AVX2 rounds activations to int16, AVX-512 keeps float32)."""
    packed, _, weight, x = case(64, 1024, 11, seed=3, kind=kind)
    got = {}
    for name in LEVELS:
        monkeypatch.setenv(numerics.ISA_VARIABLE, name)
        with prompt_pass.prompt_pass():
            got[name] = matmul(packed, x)  # [11, 64]
        exact = matmul(packed, x)
        assert relative_error(exact, x.double() @ weight.double().T) < 1e-4, name
    assert torch.equal(got["avx2"], got["avx512"])


@pytest.mark.parametrize("shape", [(24, 512), (32, 288)])
def test_q4k_tiles_refuse_shapes_they_cannot_hold(shape):
    """Rows come 16 to a tile and inputs 256 to a super-block: anything else is refused, naming the rule."""
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 256 == 0"):
        q4k_tiles.pack_q4k(lambda start, stop: None, *shape)


def test_q5k_linear_keeps_the_files_blocks(level):
    """`Q4KLinear` of a Q5_K matrix: the file's 5-bit codes (the 4-bit tiles' nibbles, then the fifth bits), 6-bit
    scales and mins and fp16 d and dmin, 5.625 bits a weight (the file's 5.5; the 5-bit tiles took 6); its loading
    name is Q5_K's."""
    raw = random_q5k(32, 2, np.random.default_rng(4))
    linear = q4k_tiles.Q4KLinear(rows_of(raw, "Q5_K"), 32, 512, type_name="Q5_K")
    stored = sum(buffer.numel() * buffer.element_size() for buffer in linear.buffers())
    assert stored * 8 / (32 * 512) == 5.625
    assert linear.type_name == linear.packed.type_name == "Q5_K"
    assert relative_error(matmul(linear.packed, torch.eye(512).bfloat16()).T,
                          gguf_values(raw, GGMLQuantizationType.Q5_K)) < 1e-6  # the weights themselves


def test_q4_0_linear_keeps_the_files_blocks_and_adds_its_bias(level):
    """`Q40Linear`: the file's codes and fp16 d (4.5 bits a weight, the file's own), nothing rounded; its bias added in
    float32."""
    raw = random_raw("Q4_0", 32, 512, seed=2)
    bias = torch.randn(32)
    linear = q4k_tiles.Q40Linear(rows_of(raw, "Q4_0"), 32, 512, bias)
    stored = sum(buffer.numel() * buffer.element_size() for buffer in linear.buffers() if buffer is not linear.bias)
    assert stored * 8 / (32 * 512) == 4.5
    d = q4_0_stored(torch.from_numpy(raw))[1]  # [32, 16] float16
    assert torch.equal(linear.packed.steps[1].view(torch.float16), d[16:].T)  # block 1: rows 16-31, [group, row]
    x = torch.randn(5, 512).bfloat16()
    with prompt_pass.prompt_pass():
        assert torch.equal(linear(x.float()), (matmul(linear.packed, x) + bias).float())


@pytest.mark.parametrize("shape", [(24, 512), (32, 80)])
def test_q4_0_tiles_refuse_shapes_they_cannot_hold(shape):
    """Rows come 16 to a tile and inputs 32 to a group: anything else is refused, naming the rule."""
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 32 == 0"):
        q4k_tiles.pack_q4_0(lambda start, stop: None, *shape)


def test_q5_0_tiles_hold_gemmas_rows(level):
    """Q5_0 rows 1,152 wide (Gemma's, which llama.cpp's Q4_K_M stores as Q5_0): the file's 5-bit codes and fp16 d
    (5.5 bits a weight), every weight gguf's own, and the int8 function within float32 rounding of its model."""
    raw = random_raw("Q5_0", 32, 1152, seed=5)
    linear = q4k_tiles.Q40Linear(rows_of(raw, "Q5_0"), 32, 1152, type_name="Q5_0")
    stored = sum(buffer.numel() * buffer.element_size() for buffer in linear.buffers())
    assert stored * 8 / (32 * 1152) == 5.5 and linear.type_name == linear.packed.type_name == "Q5_0"
    assert relative_error(matmul(linear.packed, torch.eye(1152).bfloat16()).T,
                          gguf_values(raw, GGMLQuantizationType.Q5_0)) < 1e-6  # the weights themselves
    x = torch.randn(3, 1152, generator=torch.Generator().manual_seed(5)).bfloat16()
    with prompt_pass.prompt_pass():
        assert relative_error(matmul(linear.packed, x), int8_reference(raw, x, "Q5_0")) < 1e-6
