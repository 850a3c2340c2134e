"""Prompt passes on int8 activations (each native library's `int8_tiles.h`: VNNI on AVX-512, AVX2 or AVX-VNNI): the 4-bit
and Q6_K tiles times activations quantized per group of 32, only inside `prompt_pass()` (which `CausalLM.prefill`
opens), each token computed alone; speculation stays exact against plain decoding with them. Every test runs on
each build this CPU runs (AVX2 forced by `SPECDRAFT_ISA` where the CPU has more)."""

import pytest
import torch

from specdraft import ModelDrafter, SpecdraftError, SpeculativeDecoder
from specdraft.drafters.ngram import NgramDrafter
from specdraft.kernels import gguf_matmul, int4_layout, isa, numerics, prompt_pass, tiles
from specdraft.models import causal_lm
from specdraft.models.causal_lm import CausalLM
from specdraft.models.gguf_blocks import dequantize
from test_fast_layers import int4_model, random_q6k_raw
from test_int4_tiles import affine_matrix

from conftest import avx2_library, avx512_library


@pytest.fixture(autouse=True, params=["avx512-int16", "avx512-bf16", "avx2", "avx2-vnni"])
def prompt_tiles(request, monkeypatch):
    """The tile kernel of each library build this CPU runs, the one models use (its int8 passes on the same library).
    `avx2`: without AVX-VNNI (as on a Zen 3), `avx2-vnni`: with it, where the CPU has it."""
    level, _, flavour = request.param.partition("-")
    if level == "avx2":
        if flavour == "vnni" and not isa.AVX_VNNI_CPU_FLAGS <= isa.cpu_flags():
            pytest.skip("no AVX-VNNI on this CPU")
        monkeypatch.setenv(numerics.AVX_VNNI_VARIABLE, "1" if flavour == "vnni" else "0")
        if avx2_library(flavour == "vnni") is None:
            pytest.skip("the AVX2 library does not run on this CPU")
        monkeypatch.setenv(numerics.ISA_VARIABLE, "avx2")
        kernel = tiles.AVX2
    else:
        if not tiles.AVX512.available() or avx512_library(flavour) is None:
            pytest.skip(f"no AVX-512 VNNI + BF16 ({flavour} tiles) on this CPU")
        monkeypatch.setenv(numerics.TILE_DOTS_VARIABLE, flavour)
        kernel = tiles.AVX512
    monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)  # the int8 kernels' tiles (on AMX too)
    monkeypatch.setenv(numerics.INT8_VARIABLE, "prompt")  # prompt passes only (`every` has its own tests below)
    return kernel


def int8_active() -> bool:
    """Whether a matmul now runs on int8 activations (inside an enabled pass context)."""
    return prompt_pass.precise_rows() is not None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def int4_case(tokens: int):
    codes, scale, minimum, weight = affine_matrix(96, 512, seed=tokens)
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens)).bfloat16()  # [T, K]
    kernel = tiles.tile_kernel()
    return (lambda inputs: kernel.matmul(int4_layout.pack(codes, scale, minimum, kernel.layout), inputs)), x, x.double() @ weight.double().T


def q6k_case(tokens: int):
    raw = random_q6k_raw(48, 512, seed=tokens)
    kernel = tiles.tile_kernel()
    packed = gguf_matmul.pack_q6k(torch.from_numpy(raw), kernel.layout)
    weight = dequantize(raw, "Q6_K", (48, 512))  # [N, K]
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    return (lambda inputs: kernel.q6k_matmul(packed.tiles, packed.d, inputs, 48)), x, x.double() @ weight.double().T


@pytest.mark.parametrize("case", [int4_case, q6k_case], ids=["int4", "q6k"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 40])
def test_prompt_pass_rounds_activations_to_8_bits_and_nothing_else(case, tokens):
    """Outside a prompt pass: float32 rounding of x · W (1e-5); inside: int8 activations per group of 32,
    about 0.5% on Gaussian inputs (the step is max|x| / 127), and not the bf16 path's bits."""
    matmul, x, want = case(tokens)
    assert relative_error(matmul(x), want) < 1e-5
    with prompt_pass.prompt_pass():
        got = matmul(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert 1e-3 < relative_error(got, want) < 1e-2


@pytest.mark.parametrize("case", [int4_case, q6k_case], ids=["int4", "q6k"])
def test_prompt_pass_computes_each_token_alone(case):
    """A token's output has the same bits in any pass width, so a prompt may be cut into passes anywhere (every width
    to 19: the AVX2 kernel sweeps 4 tokens at a time, a last 5 to 7 at once)."""
    matmul, x, _ = case(19)
    with prompt_pass.prompt_pass():
        together = matmul(x)
        for i in range(19):
            assert torch.equal(matmul(x[i:i + 1])[0], together[i])
        for width in range(2, 19):
            assert torch.equal(matmul(x[19 - width:]), together[19 - width:]), width


def test_prompt_pass_over_long_rows_cuts_the_tokens_into_spans():
    """4,096 inputs a row: the AVX2 kernel sweeps the rows once per 64 tokens (its int8 activations kept in L2), so 70
    tokens take two sweeps; each token still gets its own bits and the int8 error."""
    codes, scale, minimum, weight = affine_matrix(32, 4096, seed=7)
    packed = int4_layout.pack(codes, scale, minimum, tiles.tile_kernel().layout)
    raw = random_q6k_raw(16, 4096, seed=7)
    q6 = gguf_matmul.pack_q6k(torch.from_numpy(raw), tiles.tile_kernel().layout)
    x = torch.randn(70, 4096, generator=torch.Generator().manual_seed(7)).bfloat16()  # [T, K]
    cases = [(lambda inputs: tiles.tile_kernel().matmul(packed, inputs), weight),
             (lambda inputs: tiles.tile_kernel().q6k_matmul(q6.tiles, q6.d, inputs, 16), dequantize(raw, "Q6_K", (16, 4096)))]
    for matmul, w in cases:
        with prompt_pass.prompt_pass():
            together = matmul(x)  # [70, N]
            assert torch.equal(matmul(x[65:70]), together[65:70])
            assert torch.equal(matmul(x[63:64])[0], together[63])
        assert 1e-3 < relative_error(together, x.double() @ w.double().T) < 1e-2


@pytest.mark.parametrize("case", [int4_case, q6k_case], ids=["int4", "q6k"])
def test_a_sequences_first_token_stays_on_the_16_bit_kernels(case):
    """`starts_sequence`: row 0 (the attention sink) gets the 16-bit kernel's bits (either dot flavour), the others
    the int8 ones."""
    matmul, x, _ = case(9)
    plain = matmul(x)
    with prompt_pass.prompt_pass():
        int8 = matmul(x)
    with prompt_pass.prompt_pass(starts_sequence=True):
        mixed = matmul(x)
        assert torch.equal(matmul(x[:1]), plain[:1])
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[1:], int8[1:]) and not torch.equal(int8[0], plain[0])


def test_prompt_pass_can_be_switched_off(monkeypatch, prompt_tiles):
    matmul, x, _ = int4_case(4)
    plain = matmul(x)
    monkeypatch.setenv(numerics.INT8_VARIABLE, "none")
    with prompt_pass.prompt_pass():
        assert not int8_active() and torch.equal(matmul(x), plain)
    monkeypatch.setenv(numerics.INT8_VARIABLE, "prompt")
    with prompt_pass.prompt_pass():
        assert int8_active() and not torch.equal(matmul(x), plain)
    assert not int8_active()  # the pass ends with its block


def cache_keys(lm: CausalLM) -> torch.Tensor:
    return torch.cat([layer.keys.float().flatten() for layer in lm._cache.layers])


def test_prefill_runs_the_prompt_pass_and_later_passes_do_not(monkeypatch):
    """`prefill` fills the cache on int8 activations (close to, not equal to, the 16-bit kernels'); a pass
    over the cache is the same function as before."""
    lm = CausalLM(int4_model())
    prompt = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    keys, logits = {}, {}
    for mode in ("none", "prompt"):
        monkeypatch.setenv(numerics.INT8_VARIABLE, mode)
        lm.reset()
        lm.prefill(prompt[:, :-1])
        keys[mode] = cache_keys(lm)
        logits[mode] = lm.forward(prompt[:, -1:]).logits
    assert not torch.equal(keys["none"], keys["prompt"]) and relative_error(keys["prompt"], keys["none"]) < 5e-2
    lm.reset()
    lm.forward(prompt[:, :-1])  # a plain forward of the same tokens: the 16-bit kernels
    assert torch.equal(cache_keys(lm), keys["none"])


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_spec_equals_ar_with_prompt_passes(monkeypatch, drafter):
    """Plain and speculative decoding of a packed model prefill alike, so greedy outputs match exactly;
    the target's prefill and a draft model's first read of the prompt run as prompt passes, nothing else."""
    opened = []
    real = prompt_pass.prompt_pass
    def recorded(starts_sequence=False):
        opened.append(starts_sequence)
        return real(starts_sequence)

    monkeypatch.setattr(prompt_pass, "prompt_pass", recorded)
    target = int4_model(seed=2)
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 60))):
        expected = SpeculativeDecoder(CausalLM(target)).generate(prompt, max_new_tokens=30)
        assert opened == [True]
        opened.clear()
        draft = NgramDrafter() if drafter == "ngram" else ModelDrafter(CausalLM(int4_model(seed=5)), min_confidence=0.0)
        got = SpeculativeDecoder(CausalLM(target), draft, k=3).generate(prompt, max_new_tokens=30)
        assert got.token_ids == expected.token_ids and got.stats.drafted > 0
        assert opened == ([True] if drafter == "ngram" else [True, True])
        opened.clear()



# ----- every pass on int8 activations (the default on the AVX2 and AVX-512 kernels) ----------------------------------------
def test_the_modes_and_their_defaults(monkeypatch, prompt_tiles):
    """Unset: every pass where the AVX2 or AVX-512 tiles run (with their int8 kernels), prompt passes elsewhere (AMX,
    PyTorch); `every` there and a wrong name are clear errors."""
    monkeypatch.delenv(numerics.INT8_VARIABLE)
    assert tiles.int8_every_pass()
    monkeypatch.setenv(numerics.INT8_VARIABLE, "prompt")
    assert not tiles.int8_every_pass()
    monkeypatch.setenv(numerics.INT8_VARIABLE, "every")
    assert tiles.int8_every_pass()
    for other in (tiles.AMX, None):
        monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: other)
        monkeypatch.delenv(numerics.INT8_VARIABLE)
        assert not tiles.int8_every_pass()
        monkeypatch.setenv(numerics.INT8_VARIABLE, "every")
        with pytest.raises(SpecdraftError, match="every runs on the AVX2 and AVX-512 VNNI kernels only"):
            tiles.int8_every_pass()
    monkeypatch.setenv(numerics.INT8_VARIABLE, "sometimes")
    with pytest.raises(SpecdraftError, match="SPECDRAFT_INT8_ACTIVATIONS must be one of every, prompt, none"):
        numerics.current()


def every_pass_tiles(prompt_tiles, monkeypatch):
    monkeypatch.setenv(numerics.INT8_VARIABLE, "every")


def test_every_pass_runs_int8_but_a_sequences_first_token(monkeypatch, prompt_tiles):
    """Each forward opens a pass context: position 0 on the 16-bit kernels, every other pass on int8 (a decoding
    step's logits differ from the 16-bit ones), fused or not the same bits."""
    every_pass_tiles(prompt_tiles, monkeypatch)
    model = int4_model()
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    runs = {}
    for mode in ("every", "none"):
        monkeypatch.setenv(numerics.INT8_VARIABLE, mode)
        lm = CausalLM(model)
        first = lm.forward(prompt[:, :1]).logits
        rest = lm.forward(prompt[:, 1:]).logits
        steps = [lm.forward(torch.tensor([[t]])).logits for t in (3, 9, 27)]
        runs[mode] = (first, rest, steps)
    assert torch.equal(runs["every"][0], runs["none"][0])  # the attention sink's token: 16-bit both ways
    assert not torch.equal(runs["every"][2][-1], runs["none"][2][-1])
    monkeypatch.setenv(numerics.INT8_VARIABLE, "every")
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)  # every pass through transformers' layers
    lm = CausalLM(model)
    lm.forward(prompt[:, :1])
    lm.forward(prompt[:, 1:])
    unfused = [lm.forward(torch.tensor([[t]])).logits for t in (3, 9, 27)]
    assert all(torch.equal(a, b) for a, b in zip(unfused, runs["every"][2]))


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_spec_equals_ar_with_every_pass_on_int8(monkeypatch, prompt_tiles, drafter):
    """Verify passes and decoding steps compute one function on int8 activations: greedy speculation equals plain."""
    every_pass_tiles(prompt_tiles, monkeypatch)
    target = int4_model(seed=2)
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 60))):
        expected = SpeculativeDecoder(CausalLM(target)).generate(prompt, max_new_tokens=30)
        draft = NgramDrafter() if drafter == "ngram" else ModelDrafter(CausalLM(int4_model(seed=5)), min_confidence=0.0)
        got = SpeculativeDecoder(CausalLM(target), draft, k=3).generate(prompt, max_new_tokens=30)
        assert got.token_ids == expected.token_ids and got.stats.drafted > 0


def test_avx_vnni_gives_the_bits_of_avx2_alone(monkeypatch, prompt_tiles):
    """AVX-VNNI's `vpdpbusd` sums the same integers as `vpmaddubsw` + `vpaddw` (exactly, in any order), and the
    float steps are the same: every width's output has the same bits with it and without it (4-bit and Q6_K tiles,
    passes of 1 to 17 tokens, blocks of 4 and their remainders)."""
    if prompt_tiles is not tiles.AVX2 or not numerics.current().avx_vnni:
        pytest.skip("compares the two AVX2 builds where the CPU has AVX-VNNI")
    assert avx2_library(True) is not None and avx2_library(True) is not avx2_library(False)
    for case in (int4_case, q6k_case):
        for tokens in (1, 4, 5, 8, 17):
            matmul, x, _ = case(tokens)
            outputs = []
            for setting in ("1", "0"):
                monkeypatch.setenv(numerics.AVX_VNNI_VARIABLE, setting)
                with prompt_pass.prompt_pass():
                    outputs.append(matmul(x))
            assert torch.equal(outputs[0], outputs[1]), (case.__name__, tokens)

