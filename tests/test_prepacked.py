"""bf16 linears on oneDNN's prepacked weights compute PyTorch's function bit for bit, row by row, and
come off again for code that needs plain weights."""

import copy

import pytest
import torch
from torch import nn

from specdraft import ModelDrafter, SpeculativeDecoder
from specdraft.analysis.costs import token_macs, weight_bytes
from specdraft.models import prepacked
from specdraft.models.causal_lm import CausalLM
from specdraft.models.loading import load_model, prepare_draft
from specdraft.models.prepacked import PrepackedLinear, prepack_linears, unpack_linears
from specdraft.models.quantize import Int4Linear, int4_kernel_available

from conftest import tiny_config, tiny_model

pytestmark = pytest.mark.skipif(not prepacked.available(), reason="no oneDNN bf16 linear on this CPU")


def bf16_linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).bfloat16()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
def test_prepacked_linear_gives_pytorch_bits(rows, bias):
    linear = bf16_linear(48, 64, bias)
    x = torch.randn(1, rows, 64).bfloat16()  # [1, rows, K]
    with torch.inference_mode():
        out = PrepackedLinear.from_linear(linear)(x)
        assert out.shape == (1, rows, 48)
        assert torch.equal(out, linear(x))


def test_each_row_is_the_same_whatever_the_rows_beside_it():
    """A verify pass scores a token as a one-token pass does (the padding to FAST_ROWS included)."""
    linear = PrepackedLinear.from_linear(bf16_linear(256, 1536, bias=True))
    x = torch.randn(16, 1536).bfloat16()  # [16, K]
    with torch.inference_mode():
        full = linear(x)
        for rows in range(1, 16):
            assert torch.equal(linear(x[:rows]), full[:rows]), rows
        assert torch.equal(linear(x[::3]), full[::3])  # strided rows


def test_weight_comes_back_and_copies_are_independent():
    linear = bf16_linear(32, 64, bias=True)
    packed = PrepackedLinear.from_linear(linear)
    assert torch.equal(packed.weight, linear.weight)
    plain = packed.to_linear()
    assert type(plain) is nn.Linear and torch.equal(plain.weight, linear.weight) and torch.equal(plain.bias, linear.bias)
    twin = copy.deepcopy(packed)
    twin.bias.data.zero_()
    assert not torch.equal(packed.bias, twin.bias)
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(twin(x), nn.functional.linear(x, linear.weight))


def bf16_tiny(seed: int) -> nn.Module:
    return tiny_model(tiny_config(vocab_size=64), seed=seed).bfloat16()


def test_prepack_swaps_plain_bf16_linears_only_and_keeps_the_logits():
    assert prepack_linears(tiny_model(tiny_config(vocab_size=64), seed=0)) == 0  # float32: left alone
    model = bf16_tiny(seed=0)
    reference = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert isinstance(model.lm_head, PrepackedLinear)
    ids = torch.randint(64, (1, 9))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert unpack_linears(model) == linears
    assert all(type(m) is not PrepackedLinear for m in model.modules())
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_costs_count_prepacked_weights_as_before():
    model = bf16_tiny(seed=1)
    before = CausalLM(copy.deepcopy(model))
    prepack_linears(model)
    after = CausalLM(model)
    assert weight_bytes(after) == weight_bytes(before)
    assert token_macs(after) == token_macs(before)
    assert after.num_parameters() == before.num_parameters()


def test_turned_off_by_the_variable(monkeypatch):
    monkeypatch.setenv(prepacked.VARIABLE, "0")
    assert prepack_linears(bf16_tiny(seed=2)) == 0


def test_loaded_bf16_models_decode_exactly_on_prepacked_linears(tiny_model_dirs):
    """A Hugging Face folder loads prepacked; greedy speculation (chain and tree) gives plain decoding's tokens,
    and those are the tokens of the same model on PyTorch's linears."""
    target = load_model(str(tiny_model_dirs["target"]), verbose=False)
    plain = load_model(str(tiny_model_dirs["target"]), verbose=False, prepack=False)
    assert any(isinstance(m, PrepackedLinear) for m in target.model.modules())
    assert not any(isinstance(m, PrepackedLinear) for m in plain.model.modules())
    draft = prepare_draft(load_model(str(tiny_model_dirs["draft"]), verbose=False), "none", copy=True)
    prompt = [3, 17, 5, 9, 11]
    expected = SpeculativeDecoder(plain).generate(prompt, max_new_tokens=24).token_ids
    assert SpeculativeDecoder(target).generate(prompt, max_new_tokens=24).token_ids == expected
    for settings in ({"k": 4}, {"k": 4, "tree_budget": 8, "tree_branch": 2}):
        out = SpeculativeDecoder(target, ModelDrafter(draft, min_confidence=0.0), **settings).generate(prompt, max_new_tokens=24)
        assert out.token_ids == expected, settings
        assert out.stats.accepted > 0


@pytest.mark.skipif(not int4_kernel_available(), reason="no CPU int4 kernel")
def test_a_prepacked_draft_is_unpacked_before_int4(tiny_model_dirs):
    draft = load_model(str(tiny_model_dirs["draft"]), verbose=False)
    prepared = prepare_draft(draft, "int4", copy=True)
    assert not any(isinstance(m, PrepackedLinear) for m in prepared.model.modules())
    assert any(isinstance(m, Int4Linear) for m in prepared.model.modules())
    assert any(isinstance(m, PrepackedLinear) for m in draft.model.modules())  # the copy's source is left as it was
