"""The `early-exit` drafter: a view of the target's first L layers (shared weights, own cache),
its logits against a hand computation, greedy equivalence, and the exit-layer agreement helper."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from conftest import tiny_config, tiny_model
from specdraft import SamplingParams, SpecdraftError, SpeculativeDecoder
from specdraft.drafters.early_exit import EarlyExitDrafter
from specdraft.kernels import prompt_pass, tiles
from specdraft.models.early_exit import early_exit_view, exit_layer_agreement

LAYERS = 4
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40))]


@pytest.fixture(scope="module")
def deep_target() -> nn.Module:
    """A tiny 4-layer Qwen2."""
    return tiny_model(tiny_config(layers=LAYERS), seed=5)


def tensor_ptrs(model: nn.Module) -> set[int]:
    return {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}


def manual_exit_logits(model: nn.Module, tokens: torch.Tensor, exit_layer: int) -> torch.Tensor:
    """lm_head(norm(h_L)) from the full model's hidden states; tokens: [1, T] -> [1, T, V]."""
    with torch.inference_mode():
        out = model(input_ids=tokens, use_cache=False, output_hidden_states=True)
        # Entry L is layer L's output before the final norm (only the last entry has it applied).
        return model.lm_head(model.model.norm(out.hidden_states[exit_layer]))


def zero_layers_from(model: nn.Module, exit_layer: int) -> nn.Module:
    """`model` with layers exit_layer.. adding nothing to the residual stream: the exit at L is the full model."""
    with torch.no_grad():
        for layer in model.model.layers[exit_layer:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


# ----- the view ---------------------------------------------------------------------------------
def test_view_shares_weights_and_leaves_target_unchanged(deep_target, make_lm):
    target = make_lm(deep_target)
    config_before = deep_target.config.to_dict()
    base_before, layers_before = deep_target.model, list(deep_target.model.layers)
    ptrs_before = tensor_ptrs(deep_target)

    view = early_exit_view(target, 2)

    # The target is as it was: config, base model, layer list, weights.
    assert deep_target.config.to_dict() == config_before
    assert deep_target.config.num_hidden_layers == LAYERS and len(deep_target.config.layer_types) == LAYERS
    assert deep_target.model is base_before and list(deep_target.model.layers) == layers_before
    assert len(deep_target.model.layers) == LAYERS and tensor_ptrs(deep_target) == ptrs_before
    assert target.config is deep_target.config and len(target._cache.layers) == LAYERS

    # The view holds the same modules, no tensor of its own, and says 2 layers everywhere.
    hf = view.model
    assert hf is not deep_target and hf.model is not deep_target.model
    assert all(a is b for a, b in zip(hf.model.layers, layers_before[:2])) and len(hf.model.layers) == 2
    assert hf.model.embed_tokens is deep_target.model.embed_tokens
    assert hf.model.norm is deep_target.model.norm and hf.lm_head is deep_target.lm_head
    assert hf.model.rotary_emb is deep_target.model.rotary_emb
    assert tensor_ptrs(hf) <= ptrs_before
    assert view.num_parameters() < target.num_parameters()
    assert hf.config is view.config and hf.model.config is view.config
    assert view.config.num_hidden_layers == 2 and view.config.layer_types == ["full_attention"] * 2
    view.config.validate()
    assert len(view._cache.layers) == 2
    assert [layer.self_attn.layer_idx for layer in hf.model.layers] == [0, 1]
    assert view.name == "tiny[:2]" and view.tokenizer is target.tokenizer and view.vocab_size == target.vocab_size


def test_sliding_layer_types_are_cut_to_the_view():
    """Per-layer lists follow the layers: a sliding-window target's view keeps the first L layer types."""
    config = tiny_config(layers=LAYERS)
    config.use_sliding_window, config.sliding_window = True, 8
    config.layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    model = tiny_model(config, seed=6)
    from specdraft.models.causal_lm import CausalLM
    view = early_exit_view(CausalLM(model), 2)
    assert view.config.layer_types == ["full_attention", "sliding_attention"]
    assert model.config.layer_types == config.layer_types and len(model.config.layer_types) == LAYERS
    assert len(view._cache.layers) == 2
    tokens = torch.arange(1, 21).unsqueeze(0)  # [1, 20]: past the window of 8, which the sliding layer's mask keeps
    got = view.forward(tokens, logits_to_keep=20).logits
    torch.testing.assert_close(got, manual_exit_logits(model, tokens, 2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exit_layer", [1, 2, LAYERS - 1])
def test_view_logits_equal_norm_and_head_on_layer_output(deep_target, make_lm, exit_layer):
    view = early_exit_view(make_lm(deep_target), exit_layer)
    tokens = torch.tensor([[3, 17, 9, 42, 5, 8, 60, 1, 2]])  # [1, 9]
    expected = manual_exit_logits(deep_target, tokens, exit_layer)  # [1, 9, V]
    full = view.forward(tokens, logits_to_keep=9).logits
    torch.testing.assert_close(full, expected, rtol=1e-4, atol=1e-4)
    # Incrementally, against its own cache of L layers: the same logits.
    view.reset()
    first = view.forward(tokens[:, :5], logits_to_keep=5).logits
    rest = view.forward(tokens[:, 5:], logits_to_keep=4).logits
    torch.testing.assert_close(torch.cat([first, rest], 1), expected, rtol=1e-4, atol=1e-4)
    assert view.cache_len == 9 and view._cache.get_seq_length() == 9
    view.truncate(6)
    torch.testing.assert_close(view.forward(tokens[:, 6:7]).logits, expected[:, 6:7], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_view_of_other_decoder_families(make_lm, family):
    """Any model whose layers are `model.model.layers` works unchanged. Mistral's window of 8 is
    passed both by the logits (40 tokens) and by decoding, which cuts the target's sliding-window
    cache back after rejections."""
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = LlamaConfig(**sizes) if family == "llama" else MistralConfig(sliding_window=8, **sizes)
    torch.manual_seed(0)
    model = (LlamaForCausalLM if family == "llama" else MistralForCausalLM)(config).float().eval()
    target = make_lm(model)
    view = early_exit_view(target, 2)
    assert view.config.num_hidden_layers == 2 and model.config.num_hidden_layers == LAYERS
    tokens = torch.arange(1, 41).unsqueeze(0) % 64  # [1, 40]
    got = view.forward(tokens, logits_to_keep=40).logits
    torch.testing.assert_close(got, manual_exit_logits(model, tokens, 2), rtol=1e-4, atol=1e-4)
    spec = SpeculativeDecoder(target, EarlyExitDrafter(target, exit_layer=2, min_confidence=0.0), k=3)
    expected = SpeculativeDecoder(make_lm(model)).generate(PROMPTS[0], max_new_tokens=30)
    got = spec.generate(PROMPTS[0], max_new_tokens=30)
    assert got.token_ids == expected.token_ids and got.stats.accepted < got.stats.drafted  # it cut back


def test_hidden_states_are_not_captured_twice(make_lm):
    """The view and the target share layer modules; each returns one hidden state per layer (+ embeddings)."""
    model = tiny_model(tiny_config(layers=LAYERS), seed=7)  # fresh: no capture hooks installed yet
    view = early_exit_view(make_lm(model), 3)
    tokens = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert len(view.model(input_ids=tokens, use_cache=False, output_hidden_states=True).hidden_states) == 4
        assert len(model(input_ids=tokens, use_cache=False, output_hidden_states=True).hidden_states) == LAYERS + 1
        assert len(view.model(input_ids=tokens, use_cache=False, output_hidden_states=True).hidden_states) == 4


# ----- decoding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("exit_layer", [1, LAYERS - 1])
def test_greedy_early_exit_equals_ar(deep_target, make_lm, exit_layer):
    target = make_lm(deep_target)
    ar = SpeculativeDecoder(make_lm(deep_target))
    # The drafter wraps the very CausalLM the decoder verifies with: the view has its own cache.
    spec = SpeculativeDecoder(target, EarlyExitDrafter(target, exit_layer=exit_layer, min_confidence=0.0), k=3)
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=30)
        got = spec.generate(prompt, max_new_tokens=30)
        assert got.token_ids == expected.token_ids
        assert got.stats.new_tokens == 30 and got.stats.drafted > 0


def test_early_exit_on_a_model_whose_last_layers_add_nothing_is_always_accepted(make_lm):
    model = zero_layers_from(tiny_model(tiny_config(layers=LAYERS), seed=8), 2)
    target = make_lm(model)
    drafter = EarlyExitDrafter(target, exit_layer=2, min_confidence=0.0)
    assert drafter.name == "early-exit" and drafter.exit_layer == 2
    got = SpeculativeDecoder(target, drafter, k=3).generate(PROMPTS[0], max_new_tokens=20)
    assert got.token_ids == SpeculativeDecoder(make_lm(model)).generate(PROMPTS[0], max_new_tokens=20).token_ids
    assert got.stats.acceptance_rate == 1.0


def test_sampled_early_exit_completes(deep_target, make_lm):
    target = make_lm(deep_target)
    spec = SpeculativeDecoder(target, EarlyExitDrafter(target, exit_layer=2), k=3)
    params = SamplingParams(temperature=0.8, seed=11)
    first = spec.generate(PROMPTS[0], params, max_new_tokens=25)
    assert len(first.token_ids) == 25 and first.finish_reason == "length"
    assert spec.generate(PROMPTS[0], params, max_new_tokens=25).token_ids == first.token_ids  # seeded


# ----- choosing L ---------------------------------------------------------------------------------
def test_agreement_matches_the_view_and_is_one_at_the_last_layer(deep_target, make_lm):
    target = make_lm(deep_target)
    sequences = [PROMPTS[0] + [9, 8, 7], PROMPTS[1], []]
    agreement = exit_layer_agreement(target, sequences, [LAYERS, 1, 2, 3])
    assert list(agreement) == [1, 2, 3, LAYERS]
    assert agreement[LAYERS] == 1.0
    assert all(0.0 <= value <= 1.0 for value in agreement.values())
    assert target.cache_len == 0 and target._cache.get_seq_length() == 0  # no cache was used
    # The same fractions from the view's own logits, sequence by sequence.
    for layer in (1, 2, 3):
        view, matches, positions = early_exit_view(target, layer), 0, 0
        for ids in sequences[:2]:
            tokens = torch.tensor([ids])  # [1, T]
            with torch.inference_mode():
                full_argmax = deep_target(input_ids=tokens, use_cache=False).logits[0].argmax(-1)  # [T]
            view.reset()
            exit_argmax = view.forward(tokens, logits_to_keep=len(ids)).logits[0].argmax(-1)  # [T]
            matches += int((exit_argmax == full_argmax).sum())
            positions += len(ids)
        assert agreement[layer] == pytest.approx(matches / positions)


def test_agreement_is_one_where_the_last_layers_add_nothing(make_lm):
    model = zero_layers_from(tiny_model(tiny_config(layers=LAYERS), seed=9), 2)
    agreement = exit_layer_agreement(make_lm(model), [PROMPTS[0], PROMPTS[1]], [2, 3])
    assert agreement == {2: 1.0, 3: 1.0}


# ----- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("exit_layer", [0, -1, LAYERS, LAYERS + 3, 1.5, True, "2"])
def test_bad_exit_layer_is_a_clear_error(deep_target, make_lm, exit_layer):
    target = make_lm(deep_target)
    with pytest.raises(SpecdraftError, match="exit layer must be an integer from 1 to 3"):
        EarlyExitDrafter(target, exit_layer=exit_layer)
    assert len(deep_target.model.layers) == LAYERS


def test_agreement_rejects_bad_layers_and_empty_input(deep_target, make_lm):
    target = make_lm(deep_target)
    with pytest.raises(SpecdraftError, match="from 1 to 4"):
        exit_layer_agreement(target, [PROMPTS[0]], [0])
    with pytest.raises(SpecdraftError, match="non-empty"):
        exit_layer_agreement(target, [[]], [1])


def test_model_without_model_layers_is_a_clear_error(make_lm):
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    gpt2 = make_lm(GPT2LMHeadModel(config).eval())  # layers live in transformer.h
    with pytest.raises(SpecdraftError, match="model.model.layers"):
        EarlyExitDrafter(gpt2, exit_layer=1)
    with pytest.raises(SpecdraftError, match="model.model.layers"):
        exit_layer_agreement(gpt2, [[1, 2, 3]], [1])


# ----- packed GGUF modules ------------------------------------------------------------------------
def test_view_of_a_packed_gguf_model(tmp_path, make_lm):
    """Packed linears and embedding are ordinary modules: the view re-lists them and shares their storage."""
    from test_gguf_native import gguf_config, write_tiny_gguf

    from specdraft.models.gguf_native import build_native_model
    from specdraft.models.quantize import int4_kernel_available

    if not int4_kernel_available():
        pytest.skip("no CPU int4 kernel in this PyTorch build")
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, seed=0)
    model = build_native_model(path, gguf_config(), torch.float32)  # 2 layers, packed
    target = make_lm(model)
    view = early_exit_view(target, 1)
    assert tensor_ptrs(view.model) <= tensor_ptrs(model) and len(model.model.layers) == 2
    tokens = torch.tensor([[5, 100, 7, 300, 2, 9]])  # [1, 6]
    got = view.forward(tokens, logits_to_keep=6).logits
    # the pass context `CausalLM.forward` opens where every pass runs on int8 activations (the AVX2 default)
    every_pass = prompt_pass.prompt_pass(starts_sequence=True) if tiles.int8_every_pass() else contextlib.nullcontext()
    with every_pass:
        want = manual_exit_logits(model, tokens, 1)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    spec = SpeculativeDecoder(target, EarlyExitDrafter(target, exit_layer=1, min_confidence=0.0), k=3)
    expected = SpeculativeDecoder(make_lm(model)).generate(PROMPTS[0], max_new_tokens=12)
    assert spec.generate(PROMPTS[0], max_new_tokens=12).token_ids == expected.token_ids


@pytest.mark.parametrize("layers", [2, 3, 4, 8])
def test_default_exit_layer_is_a_proper_prefix(make_lm, layers):
    """Without --exit-layer the drafter picks a layer short of the last, even on very shallow targets."""
    from specdraft.drafters import make_drafter

    drafter = make_drafter("early-exit", target_model=make_lm(tiny_model(tiny_config(layers=layers), seed=1)))
    assert 1 <= drafter.exit_layer < layers
