"""Code tiles (`kernels/int8_codes.py`, `native/avx2/int8_code_tiles.h`, `native/avx512/int8_code_tiles.h`): Q8_0's
codes and IQ4's indices with the file's steps, multiplied on int16 activations on every pass; each test on every level
this CPU runs (`SPECDRAFT_ISA`)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from specdraft.kernels import int8_codes, numerics, prompt_pass
from specdraft.models.gguf_blocks import stored_codes
from conftest import stored_levels
from test_gguf_native import gguf_values, random_split_rows  # gguf's quantizer for Q8_0, random bytes for IQ4

LEVELS = stored_levels()
pytestmark = pytest.mark.skipif(not LEVELS, reason="neither the AVX2 nor the AVX-512 kernels run on this CPU")


@pytest.fixture
def level(stored_level) -> str:
    """Each level with code tiles that this CPU runs, forced."""
    assert int8_codes.available()
    return stored_level


def case(type_name: str, rows: int, inputs: int, tokens: int, seed: int = 0):
    """Packed tiles of a random `type_name` matrix, gguf's float32 values of it `[N, K]`, and bf16 inputs `[T, K]`."""
    raw = random_split_rows(type_name, rows, inputs, np.random.default_rng(seed))
    weight = gguf_values(raw, GGMLQuantizationType[type_name])  # [N, K]
    packed = int8_codes.pack_codes(lambda start, stop: stored_codes(torch.from_numpy(raw[start:stop]), type_name),
                                   rows, inputs, type_name)
    x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(seed)).bfloat16()  # [T, K]
    return packed, weight, x


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("type_name", int8_codes.TYPES)
@pytest.mark.parametrize("rows, inputs, tokens", [(48, 512, 1), (48, 512, 3), (48, 512, 17), (16, 4096, 70)])
def test_code_tiles_multiply_the_files_weights(level, type_name, rows, inputs, tokens):
    """x · W for gguf's own values of the file's weights, within float32 rounding (int8 activations would be 0.5%
    off), on a pass of one token, of a few, and of more tokens than one sweep over the rows takes (4,096 inputs: 32)."""
    packed, weight, x = case(type_name, rows, inputs, tokens)
    got = int8_codes.code_matmul(packed, x)  # [T, N]
    assert got.shape == (tokens, rows) and got.dtype == torch.float32
    assert relative_error(got, x.double() @ weight.double().T) < 1e-5


@pytest.mark.parametrize("type_name", int8_codes.TYPES)
def test_code_tiles_compute_each_token_alone(level, type_name):
    """A token's outputs have the same bits in any pass width, inside an int8 pass or out of it (code tiles take no
    int8 pass), and across the sweeps of a long pass, so a verify pass agrees with one-token decoding."""
    packed, _, x = case(type_name, 32, 4096, 70, seed=1)
    together = int8_codes.code_matmul(packed, x)  # [70, N]
    for i in (0, 31, 32, 69):
        assert torch.equal(int8_codes.code_matmul(packed, x[i:i + 1])[0], together[i])
    for width in range(2, 12):
        assert torch.equal(int8_codes.code_matmul(packed, x[30:30 + width]), together[30:30 + width]), width
    with prompt_pass.prompt_pass():
        assert torch.equal(int8_codes.code_matmul(packed, x[3:9]), together[3:9])


@pytest.mark.parametrize("type_name, bits", [("Q8_0", 8.5), ("IQ4_NL", 5), ("IQ4_XS", 5)])
def test_code_linear_keeps_the_files_codes_and_adds_its_bias(level, type_name, bits):
    """`CodeLinear`: Q8_0's codes and fp16 steps (the file's 8.5 bits a weight), IQ4's indices and float32 steps (5),
    nothing rounded; its bias added in float32."""
    raw = random_split_rows(type_name, 32, 512, np.random.default_rng(2))
    weight = gguf_values(raw, GGMLQuantizationType[type_name])
    bias = torch.randn(32)
    linear = int8_codes.CodeLinear(lambda start, stop: stored_codes(torch.from_numpy(raw[start:stop]), type_name),
                                   32, 512, type_name, bias)
    stored = linear.tiles.numel() + linear.tile_steps.numel() * linear.tile_steps.element_size()
    assert stored * 8 == bits * 32 * 512
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    assert relative_error(linear(x), x.bfloat16().double() @ weight.double().T + bias.double()) < 1e-5


@pytest.mark.skipif(len(LEVELS) < 2, reason="needs both the AVX2 and the AVX-512 kernels")
@pytest.mark.parametrize("type_name", int8_codes.TYPES)
def test_code_tiles_give_the_same_bits_on_avx2_and_avx512(type_name, monkeypatch):
    """Both levels compute one function in one order (the same int16 activations, exact integer sums, the same float32
    steps per 16 inputs), so a model's outputs do not depend on which runs; 40 rows: AVX-512 pairs blocks of 8 rows,
    and its last block computes alone."""
    packed, _, x = case(type_name, 40, 512, 13, seed=4)
    got = {}
    for name in LEVELS:
        monkeypatch.setenv(numerics.ISA_VARIABLE, name)
        got[name] = int8_codes.code_matmul(packed, x)  # [13, 40]
    assert torch.equal(got["avx2"], got["avx512"])


def test_code_tiles_refuse_what_they_cannot_hold():
    """Another type, rows not a multiple of 8, or inputs not whole groups (IQ4_XS: not whole blocks of 256): a clear
    error."""
    rows = lambda start, stop: (torch.zeros(stop - start, 1), torch.zeros(stop - start, 1, 32, dtype=torch.int16))
    with pytest.raises(ValueError, match="no code tiles for Q4_K"):
        int8_codes.pack_codes(rows, 16, 32, "Q4_K")
    for shape in ((12, 32), (16, 48)):
        with pytest.raises(ValueError, match="need N % 8 == 0 and K % 32 == 0"):
            int8_codes.pack_codes(rows, *shape, "Q8_0")
    with pytest.raises(ValueError, match="need N % 8 == 0 and K % 256 == 0"):
        int8_codes.pack_codes(rows, 16, 128, "IQ4_XS")
