"""Stacked projections (q, k, v in one kernel call; gate and up in one), native norms and rotary, and the
fused layer stack (one C call a pass) change no output bit."""

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from transformers.activations import GELUTanh
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from specdraft.kernels import bindings, decoder_layers, dense_matmul, gguf_matmul, int8_codes, isa, layer_ops, numerics, tiles

from conftest import avx2_library, avx512_library
from specdraft.models import causal_lm
from specdraft.models.causal_lm import CausalLM
from specdraft.models.early_exit import early_exit_view
from specdraft.models.fused_decoder import fused_decoder
from specdraft.bench.random_gguf import tiny_config as family_config, write_random_gguf
from specdraft.models.gguf_config import gguf_config
from specdraft.models.gguf_native import build_native_model
from specdraft.gguf_layout import Q6K_BLOCK_BYTES
from specdraft.models.gguf_blocks import five_bit_affine, stored_codes, split_affine
from specdraft.models.quantize import Int4Linear, SplitInt4Linear, five_bit_tiles_run, quantize_int4
from specdraft.models import fast_layers
from specdraft.models.fast_layers import StackedAttention, StackedMLP, StackedProjection, NativeRMSNorm, fast_decoder_layers

tiles_run = pytest.mark.skipif(Int4Linear.from_affine(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2),
                                                      torch.zeros(16, 2)).tiles is None, reason="no tile kernel here")


STACKED_FAMILIES = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig, "qwen3": Qwen3Config,
                    "phi3": Phi3Config, "gemma3": Gemma3TextConfig, "gemma2": Gemma2Config}  # the families whose layers stack
# (`models/architectures.py`); Gemma 3: a sliding layer of a 4-token window (shorter than every pass sequence here)
# and a full one, each with its rotary base, and its query scale
GEMMA3 = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)
# Gemma 2: Gemma 3's layers without norms over q's and k's heads, with soft-caps small enough to bite on scores and
# logits this small
GEMMA2 = {**GEMMA3, "attn_logit_softcapping": 0.01, "final_logit_softcapping": 0.05}
FAMILY_OVERRIDES = {"gemma3": GEMMA3, "gemma2": GEMMA2}


def int4_model(seed: int = 0, family: str = "qwen2", **overrides) -> Qwen2ForCausalLM:
    """A 2-layer model (unless `overrides` say otherwise) of a stacked family (hidden 64: the tile kernels' smallest; heads of 32: the C rotary's)
    with every linear re-quantized to 4 bits (Qwen2's q, k, v biases random; every norm random around its identity:
    Gemma's 1 + w too)."""
    config = STACKED_FAMILIES[family](
        vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=128, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False, **{"num_hidden_layers": 2, "sliding_window": None,
                                      **FAMILY_OVERRIDES.get(family, {}), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).bfloat16().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (getattr(layer.self_attn, f"{n}_proj", None) for n in "qkv"):
                if proj is not None and proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
            for norm in (getattr(layer.self_attn, n, None) for n in ("q_norm", "k_norm")):
                if norm is not None:
                    norm.weight.normal_(1, 0.3)
        for name, weight in model.named_parameters():
            if family.startswith("gemma") and name.endswith("norm.weight"):  # w of Gemma's 1 + w
                weight.normal_(0, 0.3)
    quantize_int4(model)
    return model


def passes(model: Qwen2ForCausalLM) -> list[torch.Tensor]:
    """Logits of a prefill and passes of 1, 5 and 3 tokens over the cache: [1, T, V] each."""
    lm = CausalLM(model)
    lm.reset()
    generator = torch.Generator().manual_seed(1)
    return [lm.forward(torch.randint(0, 96, (1, n), generator=generator), logits_to_keep=n).logits
            for n in (11, 1, 5, 3)]


@tiles_run
@pytest.mark.parametrize("family", STACKED_FAMILIES)
def test_stacked_layers_give_the_same_logits_bit_for_bit(family, monkeypatch):
    model = int4_model(family=family)
    stacked = copy.deepcopy(model)
    with monkeypatch.context() as patch:  # the reference: the same norms, projections one by one
        patch.setattr(fast_layers, "run_kind", lambda linear: None)
        assert fast_decoder_layers(model) == 0
    assert fast_decoder_layers(stacked) == 2
    layer = stacked.model.layers[0]
    assert isinstance(layer.self_attn, StackedAttention) and isinstance(layer.mlp, StackedMLP)
    assert len(layer.self_attn.qkv.runs) == 1 and len(layer.mlp.gate_up.runs) == 1  # one kernel call each
    assert (layer.self_attn.q_norm is not None) == (family in ("qwen3", "gemma3"))
    for want, got in zip(passes(model), passes(stacked)):
        assert torch.equal(want, got)
    assert CausalLM(stacked).num_parameters() == CausalLM(model).num_parameters()


def test_models_without_tile_kernels_are_left_alone():
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()  # plain nn.Linear projections
    assert fast_decoder_layers(model) == 0
    assert isinstance(model.model.layers[0].mlp.gate_proj, nn.Linear)


def random_q6k_raw(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q6_K bytes `[rows, cols / 256 · 210]` of random codes and scales with small positive d."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, Q6K_BLOCK_BYTES), dtype=np.uint8)
    raw[..., 208:210] = np.frombuffer(rng.uniform(1e-3, 2e-3, (rows, cols // 256)).astype(np.float16).tobytes(),
                                      dtype=np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def random_q6k_linear(rows: int, cols: int, seed: int) -> gguf_matmul.BlockLinear:
    """A Q6_K linear of `random_q6k_raw` weights and a random bias."""
    return gguf_matmul.BlockLinear(torch.from_numpy(random_q6k_raw(rows, cols, seed)), "Q6_K", torch.randn(rows))


@tiles_run
@pytest.mark.skipif(not gguf_matmul.available(), reason="no Q6_K tile kernel here")
def test_mixed_block_types_run_one_call_per_type_with_the_same_outputs():
    """q and k in 4 bits, v in Q6_K (a Q4_K_M file's mix): two calls, each part's rows as computed alone."""
    generator = torch.Generator().manual_seed(2)
    q = Int4Linear.quantize(nn.Linear(512, 64, bias=True))
    k = Int4Linear.quantize(nn.Linear(512, 32, bias=True))
    v = random_q6k_linear(32, 512, seed=3)
    stacked = StackedProjection([q, k, v])
    assert len(stacked.runs) == 2 and stacked.out_features == 128
    x = torch.randn(2, 5, 512, generator=generator).bfloat16()  # [B, T, K]
    out = stacked(x)  # [2, 5, 128] float32
    parts = [q(x), k(x), v(x)]  # each rounded to bf16, as the layers use them
    assert torch.equal(out.to(torch.bfloat16), torch.cat(parts, dim=-1))


@pytest.mark.skipif(not layer_ops.available(), reason="no native layer operations here")
def test_native_rms_norm_matches_transformers_and_each_row_stands_alone():
    norm = Qwen2RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(256))
    norm = norm.bfloat16()
    x = (3 * torch.randn(2, 7, 256)).bfloat16()  # [B, T, H]
    native = NativeRMSNorm(norm)
    got, want = native(x), norm(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)  # a bf16 step at most
    assert (got != want).float().mean() < 0.02  # almost every value the same bits
    assert torch.equal(native(x[1:, 3:4]), got[1:, 3:4])  # a row alone gives the same bits


@pytest.mark.skipif(not layer_ops.available(), reason="no native layer operations here")
def test_native_gemma_rms_norm_matches_transformers_and_each_row_stands_alone():
    """Gemma's norm, bf16(x / rms(x) · (1 + w)) with the products in float32."""
    norm = Gemma3RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(256))
    norm = norm.bfloat16()
    x = (3 * torch.randn(2, 7, 256)).bfloat16()  # [B, T, H]
    native = NativeRMSNorm(norm, offset=1.0)
    got, want = native(x), norm(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)  # a bf16 step at most
    assert (got != want).float().mean() < 0.02
    assert torch.equal(native(x[1:, 3:4]), got[1:, 3:4])


def test_fast_layers_swap_norms_only_where_the_kernel_runs():
    model = int4_model()
    fast_decoder_layers(model)
    kinds = {type(layer.input_layernorm).__name__ for layer in model.model.layers}
    assert kinds == ({"NativeRMSNorm"} if layer_ops.available() else {"Qwen2RMSNorm"})
    float_model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    fast_decoder_layers(float_model)  # float32 weights: PyTorch's norm stays
    assert type(float_model.model.norm).__name__ == "Qwen2RMSNorm"


@pytest.mark.skipif(not layer_ops.available(), reason="no native layer operations here")
@pytest.mark.parametrize("dim, tokens", [(128, 1), (64, 5), (32, 8)])
def test_native_rotary_gives_transformers_bits(dim, tokens):
    """q and k heads of a stacked q|k|v row rotated in place equal `apply_rotary_pos_emb` in bf16; v untouched."""
    heads, kv_heads = 4, 2
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    angles = 40 * torch.rand(1, tokens, dim // 2, generator=g)
    cos = torch.cat([angles.cos()] * 2, dim=-1).bfloat16()  # [1, T, d]
    sin = torch.cat([angles.sin()] * 2, dim=-1).bfloat16()
    q = qkv[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotated = qkv.clone()
    layer_ops.rotary_(rotated, heads + kv_heads, dim, cos, sin)
    assert torch.equal(rotated[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2), want_q)
    assert torch.equal(rotated[..., heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim)
                       .transpose(1, 2), want_k)
    assert torch.equal(rotated[..., (heads + kv_heads) * dim :], qkv[..., (heads + kv_heads) * dim :])


# ----- the fused decoder: the whole layer stack in one C call ----------------------------------------------
fused_run = pytest.mark.skipif(not decoder_layers.available(), reason="no fused decoder kernel here")


def mixed_model() -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (hidden 256, heads of 64) in 4 bits whose first layer has v and down in Q6_K (a Q4_K_M mix)."""
    config = Qwen2Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = Qwen2ForCausalLM(config).bfloat16().eval()
    quantize_int4(model)
    layer = model.model.layers[0]
    layer.self_attn.v_proj = random_q6k_linear(128, 256, seed=6)
    layer.mlp.down_proj = random_q6k_linear(256, 512, seed=7)
    layer.mlp.down_proj.bias = None
    return model


def q8_0_split_linear(linear: nn.Linear) -> SplitInt4Linear:
    """A float linear written as Q8_0 blocks and read back as two 4-bit halves (`gguf_blocks.split_affine`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(linear.weight.detach().float().numpy(), GGMLQuantizationType.Q8_0)  # [N, K / 32 · 34]
    split = SplitInt4Linear(Int4Linear.from_affine(*split_affine(torch.from_numpy(raw), "Q8_0"),
                                                   None if linear.bias is None else linear.bias.detach().float()))
    return split


def q5_0_linear(linear: nn.Linear) -> Int4Linear:
    """A float linear written as Q5_0 blocks and read back as 5-bit tiles (`gguf_blocks.five_bit_affine`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(linear.weight.detach().float().numpy(), GGMLQuantizationType.Q5_0)  # [N, K / 32 · 22]
    return Int4Linear.from_affine(*five_bit_affine(torch.from_numpy(raw), "Q5_0"),
                                  None if linear.bias is None else linear.bias.detach().float(), bits=5)


def code_linear(type_name: str) -> Callable[[nn.Linear], nn.Module]:
    """A float linear written as `type_name` blocks and read back as the file's codes (`int8_codes.CodeLinear`): Q8_0
    by gguf's quantizer; IQ4_NL (which gguf cannot quantize) as random indices with steps near the linear's scale."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    def make(linear: nn.Linear) -> nn.Module:
        rows, inputs = linear.weight.shape
        kind = GGMLQuantizationType[type_name]
        if type_name == "Q8_0":
            raw = quantize(linear.weight.detach().float().numpy(), kind)  # [N, K / 32 · 34]
        else:
            rng = np.random.default_rng(rows + inputs)
            weights, block_bytes = GGML_QUANT_SIZES[kind]
            raw = rng.integers(0, 256, (rows, inputs // weights, block_bytes), dtype=np.uint8)
            d = rng.uniform(2e-4, 1e-3, raw.shape[:2]).astype(np.float16)
            raw[..., 0:2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
            raw = raw.reshape(rows, -1)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return int8_codes.CodeLinear(lambda start, stop: stored_codes(torch.from_numpy(raw[start:stop]), type_name),
                                     rows, inputs, type_name, bias)
    return make


def int4_model_with(seed: int, replaced: dict[str, Callable[[nn.Linear], nn.Module]]) -> Qwen2ForCausalLM:
    """`int4_model(seed)` with the projections named (`layers.0.mlp.down_proj`) made anew by `replaced[name]` from a
    float model's projection of that name."""
    model = int4_model(seed=seed)
    reference = Qwen2ForCausalLM(model.config).bfloat16().eval()
    for name, make in replaced.items():
        model.model.set_submodule(name, make(reference.model.get_submodule(name)))
    return model


def five_bit_model() -> Qwen2ForCausalLM:
    """`int4_model` with some projections in Q5_0 as 5-bit tiles: q and down of the first layer (q stacks beside
    4-bit k and v as runs of two widths), v of the second, and the second's down as Q8_0 split halves."""
    return int4_model_with(9, {"layers.0.self_attn.q_proj": q5_0_linear, "layers.0.mlp.down_proj": q5_0_linear,
                               "layers.1.self_attn.v_proj": q5_0_linear, "layers.1.mlp.down_proj": q8_0_split_linear})


def split_model() -> Qwen2ForCausalLM:
    """`int4_model` with some projections in Q8_0 (split halves): v and down of the first layer, q of the second."""
    return int4_model_with(8, {name: q8_0_split_linear for name in ("layers.0.self_attn.v_proj", "layers.0.mlp.down_proj",
                                                                    "layers.1.self_attn.q_proj")})


def pass_sequence(model: Qwen2ForCausalLM, tree: bool = True) -> list[torch.Tensor]:
    """Logits and hidden states of a prefill, chain passes, a tree pass (unless not `tree`: past a sliding window,
    `CausalLM` refuses one) and passes after cutting the cache back."""
    lm = CausalLM(model)
    generator = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(0, 96, (1, n), generator=generator)  # noqa: E731
    out = [lm.forward(tokens(11), logits_to_keep=11).logits]
    for n in (1, 5, 3, 18):  # 18: past a pass of either tile kernel (8 tokens on AVX-512, 16 on AMX)
        step = lm.forward(tokens(n), logits_to_keep=n, hidden_to_keep=n)
        out += [step.logits, step.hidden_states]
    lm.truncate(lm.cache_len - 4)  # a rejected draft
    if tree:  # a root's two children, and a grandchild of the first (depths 1, 1, 2)
        visible = torch.tensor([[True, False, False], [False, True, False], [True, False, True]])
        step = lm.forward(tokens(3), logits_to_keep=3, hidden_to_keep=3, offsets=torch.tensor([0, 0, 1]),
                          visible=visible)
        out += [step.logits, step.hidden_states]
        lm.keep(lm.cache_len - 3, [0, 2])  # the accepted path
    out.append(lm.forward(tokens(2), logits_to_keep=2).logits)
    return out


@pytest.fixture(params=["avx512-int16", "avx512-bf16", "avx2"])
def decoder_build(request, monkeypatch):
    """Each build of the fused decoder this CPU runs: AVX-512 in both dot flavours, and AVX2 (forced by `SPECDRAFT_ISA`
    where the CPU has more)."""
    level, _, flavour = request.param.partition("-")
    if level == "avx2":
        if avx2_library() is None:
            pytest.skip("the AVX2 decoder does not run on this CPU")
        monkeypatch.setenv(numerics.ISA_VARIABLE, "avx2")
    else:
        if not numerics.current().allows("avx512") or avx512_library(flavour) is None:
            pytest.skip(f"the AVX-512 {flavour} tile kernels do not run on this CPU")
        monkeypatch.setenv("SPECDRAFT_TILE_DOTS", flavour)
    assert decoder_layers.level() == level
    return level


@tiles_run
@fused_run
@pytest.mark.parametrize("build", [int4_model, mixed_model, split_model])
@pytest.mark.parametrize("kernel", [None, tiles.AVX512], ids=["fastest", "avx512"])
def test_fused_layers_compute_the_pytorch_path_bit_for_bit(build, kernel, decoder_build, monkeypatch):
    if kernel is not None:  # on an AMX machine, also the AVX-512 4-bit runs (the decoder's AMX build takes both)
        if decoder_build != "avx512":
            pytest.skip("AVX-512 tiles run under the AVX-512 decoder only")
        monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)
    model = build()
    fast_decoder_layers(model)
    fused = fused_decoder(model)
    assert fused is not None and len(fused.table) == 2
    int4_kind = decoder_layers.INT4_AMX if kernel is None and tiles.AMX.available() else decoder_layers.INT4
    assert fused.table[1].qkv.run[0].kind == int4_kind
    got = pass_sequence(model)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)  # every pass through transformers' layers
    want = pass_sequence(model)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@tiles_run
@fused_run
@pytest.mark.parametrize("kernel", [None, tiles.AVX512], ids=["fastest", "avx512"])
def test_fused_layers_run_five_bit_tiles_bit_for_bit(kernel, decoder_build, monkeypatch):
    """5-bit runs (Q5_0 as stored), stacked beside 4-bit ones and beside split halves, on the fused stack as on the
    PyTorch path, bit for bit: on AMX, AVX-512 and AVX2 (every pass on int8 activations on the last two, by
    default)."""
    if kernel is not None:  # on an AMX machine, also the AVX-512 runs (the decoder's AMX build takes both)
        if decoder_build != "avx512":
            pytest.skip("AVX-512 tiles run under the AVX-512 decoder only")
        monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)
    assert five_bit_tiles_run(64, 128)
    model = five_bit_model()
    fast_decoder_layers(model)
    fused = fused_decoder(model)
    assert fused is not None
    amx = kernel is None and tiles.AMX.available()
    four, five = (decoder_layers.INT4_AMX, decoder_layers.INT5_AMX) if amx else (decoder_layers.INT4, decoder_layers.INT5)
    kinds = [[run.kind for run in entry.qkv.run[:entry.qkv.runs]] for entry in fused.table]
    assert kinds == [[five, four], [four, five]]
    assert fused.table[0].down.run[0].kind == five
    got = pass_sequence(model)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    assert all(torch.equal(w, g) for w, g in zip(pass_sequence(model), got))


@tiles_run
@fused_run
def test_fused_layers_run_code_tiles_bit_for_bit(decoder_build, monkeypatch):
    """Q8_0 and IQ4 linears as the file's codes (the AVX2 and AVX-512 levels' code tiles), stacked beside 4-bit runs,
    on the fused stack as on the PyTorch path, bit for bit."""
    if not int8_codes.available():
        pytest.skip("code tiles run on the AVX2 and AVX-512 tile kernels (not AMX's)")
    model = int4_model_with(10, {"layers.0.self_attn.v_proj": code_linear("Q8_0"),
                                 "layers.0.mlp.down_proj": code_linear("IQ4_NL"),
                                 "layers.1.self_attn.q_proj": code_linear("IQ4_NL"),
                                 "layers.1.mlp.down_proj": code_linear("Q8_0")})
    fast_decoder_layers(model)
    fused = fused_decoder(model)
    assert fused is not None
    kinds = [[run.kind for run in entry.qkv.run[:entry.qkv.runs]] for entry in fused.table]
    assert kinds == [[decoder_layers.INT4, decoder_layers.Q8_0], [decoder_layers.IQ4, decoder_layers.INT4]]
    assert [entry.down.run[0].kind for entry in fused.table] == [decoder_layers.IQ4, decoder_layers.Q8_0]
    got = pass_sequence(model)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    assert all(torch.equal(w, g) for w, g in zip(pass_sequence(model), got))


@tiles_run
@fused_run
@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "qwen3", "gemma3", "gemma2"])
def test_fused_layers_run_each_stacked_family_bit_for_bit(family, decoder_build, monkeypatch):
    """Llama and Mistral (no biases), Phi-3 (q|k|v and gate|up stored stacked), Qwen3 (norms over each head of
    q and k), Gemma 3 (its norms, sandwich norms, GELU, query scale, a rotary table per layer type; its window
    here wider than the sequence, so that the tree pass runs) and Gemma 2 (the same layers without head norms, one
    rotary table, soft-capped scores and logits) run on the fused stack."""
    model = int4_model(family=family, **({"sliding_window": 64} if family.startswith("gemma") else {}))
    fast_decoder_layers(model)
    assert fused_decoder(model) is not None
    got = pass_sequence(model)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    assert all(torch.equal(w, g) for w, g in zip(pass_sequence(model), got))


@tiles_run
@fused_run
@pytest.mark.parametrize("mix", ["F16", "BF16", "F32", "Q4_K_M", "Q4_0"])
def test_fused_layers_run_dense_weights_bit_for_bit(mix, decoder_build, tmp_path, monkeypatch):
    """A file's F16, BF16 and F32 linears, kept as stored, run on the fused stack (one C call a pass, as their stacked
    PyTorch layers compute), bit for bit; in a Q4_K_M file they sit beside 4-bit and Q6_K runs (here none: the tiny
    model's rows fit the K-quants: no dense run there), and on the AVX2 and AVX-512 levels its Q4_K linears run as
    Q4_K tiles, a Q4_0 file's as Q4_0 tiles (AMX keeps its bf16 tiles)."""
    if mix != "Q4_K_M" and not dense_matmul.available():
        pytest.skip("the loader keeps F16, BF16 and F32 on PyTorch's bf16 linears on this level")
    path = write_random_gguf(family_config("llama"), tmp_path / f"llama-{mix}.gguf", mix, seed=2)
    model = build_native_model(path, gguf_config(path), torch.bfloat16)
    fused = fused_decoder(model)
    assert fused is not None
    kinds = {run.kind for entry in fused.table for p in (entry.qkv, entry.o, entry.gate_up, entry.down)
             for run in p.run[:p.runs]}
    dense_kinds = {"F16": decoder_layers.F16, "BF16": decoder_layers.BF16, "F32": decoder_layers.F32}
    assert kinds == {dense_kinds[mix]} if mix in dense_kinds else not kinds & set(dense_kinds.values())
    stored = tiles.tile_kernel() in (tiles.AVX2, tiles.AVX512)
    assert (decoder_layers.Q4K in kinds) == (stored and mix == "Q4_K_M")
    assert (decoder_layers.Q4_0 in kinds) == (stored and mix == "Q4_0")
    got = pass_sequence(model)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    assert all(torch.equal(w, g) for w, g in zip(pass_sequence(model), got))


@tiles_run
@fused_run
def test_fused_layers_run_q5_0_rows_as_stored(decoder_build, tmp_path, monkeypatch):
    """Rows whose width no K-quant fits (160 here; Gemma's 1,152), which llama.cpp's Q4_K_M stores as Q5_0, run as Q5_0
    tiles beside the Q4_K ones on the AVX2 and AVX-512 levels (5-bit tiles on AMX), in one C call a pass, bit for bit
    as the stacked PyTorch layers compute them."""
    config = family_config("llama", hidden_size=160)
    path = write_random_gguf(config, tmp_path / "llama-160-Q4_K_M.gguf", "Q4_K_M", seed=3)
    model = build_native_model(path, gguf_config(path), torch.bfloat16)
    fused = fused_decoder(model)
    assert fused is not None
    kinds = {run.kind for entry in fused.table for p in (entry.qkv, entry.o, entry.gate_up, entry.down)
             for run in p.run[:p.runs]}
    stored = tiles.tile_kernel() in (tiles.AVX2, tiles.AVX512)
    assert (decoder_layers.Q5_0 in kinds) == stored and (decoder_layers.Q4K in kinds) == stored, kinds
    got = pass_sequence(model)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    assert all(torch.equal(w, g) for w, g in zip(pass_sequence(model), got))


@tiles_run
@fused_run
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
@pytest.mark.parametrize("kernel", [None, tiles.AVX512], ids=["fastest", "avx512"])
def test_fused_sliding_window_layers_match_past_their_window(family, kernel, decoder_build, monkeypatch):
    """Gemma 3's sliding layer (a window of 4) and Mistral's windowed layers (a window of 6) attend to the last
    tokens only, on the fused stack as on the PyTorch path, bit for bit, over passes that reach 38 tokens and cut
    back; without the window the fused logits differ (the window is what they compute)."""
    if kernel is not None:
        if decoder_build != "avx512":
            pytest.skip("AVX-512 tiles run under the AVX-512 decoder only")
        monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)
    model = int4_model(family=family, **({"sliding_window": 6} if family == "mistral" else {}))
    fast_decoder_layers(model)
    fused = fused_decoder(model)
    assert fused is not None and [entry.window for entry in fused.table] == ([4, 0] if family == "gemma3" else [6, 6])
    got = pass_sequence(model, tree=False)
    windows = [entry.window for entry in fused.table]
    for entry in fused.table:
        entry.window = 0
    unwindowed = pass_sequence(model, tree=False)
    for entry, window in zip(fused.table, windows):
        entry.window = window
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    want = pass_sequence(model, tree=False)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert not torch.equal(got[-1], unwindowed[-1])


BUILDS = {  # each kernel build of the fused stack: (SPECDRAFT_ISA, SPECDRAFT_TILE_DOTS, SPECDRAFT_AVX_VNNI, the
    # 4-bit run kind it takes)
    "amx": ("amx", "int16", None, decoder_layers.INT4_AMX),
    "avx512-int16": ("avx512", "int16", None, decoder_layers.INT4),
    "avx512-bf16": ("avx512", "bf16", None, decoder_layers.INT4),
    "avx2": ("avx2", None, "0", decoder_layers.INT4),
    "avx2-avx_vnni": ("avx2", None, "1", decoder_layers.INT4),
}


@pytest.fixture(params=list(BUILDS))
def forced_build(request, monkeypatch) -> int:
    """Each build of the fused stack this CPU runs, forced by the `SPECDRAFT_*` variables (AVX-512 + AMX tiles,
    AVX-512 in both dot flavours, AVX2 with and without AVX-VNNI); the 4-bit run kind its layers take."""
    level, dots, vnni, kind = BUILDS[request.param]
    if not isa.CPU_FLAGS[level] <= isa.cpu_flags() or (vnni == "1" and not isa.AVX_VNNI_CPU_FLAGS <= isa.cpu_flags()):
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    monkeypatch.setenv(numerics.ISA_VARIABLE, level)
    for variable, value in ((numerics.TILE_DOTS_VARIABLE, dots), (numerics.AVX_VNNI_VARIABLE, vnni)):
        if value is not None:
            monkeypatch.setenv(variable, value)
    if level == "amx" and not tiles.AMX.available():
        pytest.skip("the OS does not grant AMX's tile state here")
    if decoder_layers.level() != ("avx512" if level == "amx" else level):
        pytest.skip(f"the {request.param} decoder does not build here")
    return kind


class _Reader:
    """Stands for a drafter that claims feature layers (`CausalLM.read_features_at` holds its owner weakly)."""


@tiles_run
@fused_run
@pytest.mark.parametrize("build, layers", [(lambda: int4_model(num_hidden_layers=3), (2, 0, 1)),
                                           (mixed_model, (1, 1, 0))], ids=["int4", "q4_k_m-mix"])
def test_fused_layers_hand_out_the_feature_layers_a_drafter_reads(build, layers, forced_build, monkeypatch):
    """While a drafter claims layers (EAGLE-3's low, middle, high: here out of order and one twice), the few-token
    passes stay on the fused stack, which copies out the rows entering those layers: the same bits as
    transformers' `hidden_states[i]` on the unfused path, for chain, wide (18 tokens) and tree passes (and the same
    logits), on every kernel build."""
    model = build()
    fast_decoder_layers(model)
    fused = fused_decoder(model)
    assert fused is not None and fused.table[0].qkv.run[0].kind == forced_build
    reader = _Reader()
    CausalLM(model).read_features_at(reader, layers)
    asked = []
    run = type(fused).run
    monkeypatch.setattr(type(fused), "run", lambda self, *args: asked.append(args[-1]) or run(self, *args))
    got = pass_sequence(model)
    assert [feature_layers for feature_layers in asked if feature_layers is not None] == [layers] * 5
    assert all(state.shape[-1] == 3 * model.config.hidden_size for state in got[2:11:2])
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    want = pass_sequence(model)
    assert all(torch.equal(w, g) for w, g in zip(want, got))


@tiles_run
@fused_run
@pytest.mark.parametrize("kernel", [None, tiles.AVX512], ids=["fastest", "avx512"])
def test_fused_soft_caps_are_computed(kernel, decoder_build, monkeypatch):
    """Gemma 2's soft-caps run fused (its attention's in C, its logits' after the head), bit for bit as on the
    PyTorch path (`test_fused_layers_run_each_stacked_family_bit_for_bit`); without either cap the fused logits
    differ (each is what they compute)."""
    if kernel is not None:
        if decoder_build != "avx512":
            pytest.skip("AVX-512 tiles run under the AVX-512 decoder only")
        monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)
    model = int4_model(family="gemma2", sliding_window=64)
    fast_decoder_layers(model)
    fused = fused_decoder(model)
    assert fused is not None and (fused.softcap, fused.final_softcap) == (0.01, 0.05)
    got = pass_sequence(model)
    for cap in ("softcap", "final_softcap"):
        kept = getattr(fused, cap)
        setattr(fused, cap, None)
        assert not torch.equal(pass_sequence(model)[-1], got[-1]), cap
        setattr(fused, cap, kept)
    monkeypatch.setattr(causal_lm, "fused_decoder", lambda model: None)
    assert all(torch.equal(w, g) for w, g in zip(pass_sequence(model), got))


@tiles_run
@fused_run
def test_fused_decoder_belongs_to_its_model_copies_and_views():
    model = int4_model()
    fast_decoder_layers(model)
    want = pass_sequence(model)
    twin = copy.deepcopy(model)
    assert fused_decoder(twin) is not fused_decoder(model)  # its own table, pointing into its own tensors
    with torch.no_grad():  # the original's weights change: the copy must not notice
        for layer in model.model.layers:
            layer.input_layernorm.weight.zero_()
    assert all(torch.equal(w, g) for w, g in zip(want, pass_sequence(twin)))
    view = early_exit_view(CausalLM(twin), 1)
    assert len(fused_decoder(view.model).table) == 1 and len(fused_decoder(twin).table) == 2
    fast_decoder_layers(twin)  # layers swapped again: what was kept is forgotten
    assert fused_decoder(twin) is not None


def test_fused_decoder_needs_every_layer_on_tile_kernels():
    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).bfloat16()
    fast_decoder_layers(dense)
    assert fused_decoder(dense) is None


@fused_run
@pytest.mark.skipif(not decoder_layers.same_silu_as_torch(), reason="PyTorch's exp is not reachable here")
def test_silu_mul_gives_pytorch_bits():
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 8.0, 200.0):
        gate_up = (scale * torch.randn(3, 2 * 128, generator=g)).bfloat16()
        want = torch.nn.functional.silu(gate_up[:, :128]) * gate_up[:, 128:]
        assert torch.equal(decoder_layers.silu_mul(gate_up), want)


@fused_run
def test_act_mul_gives_pytorch_bits_for_every_bf16_gate(decoder_build):
    """A table of Gemma's GELU (tanh) times up gives `act_fn(gate) * up` as PyTorch computes it on a stacked gate|up,
    for all 65,536 bf16 gates (NaNs and infinities too) whose activation and product lie in float32's normal range
    (|y| >= 1.2e-38). Below it PyTorch's GELUs differ with the layout (on a contiguous tensor, as the table was made,
    they may flush subnormal values to zero, on a stacked gate|up not), and the AVX-512 BF16 rounding flushes
    subnormal products to zero, as in every kernel here."""
    act_fn = GELUTanh()
    gate = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)  # [65536]
    up = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    gate_up = torch.cat([gate.view(128, 512), up.view(128, 512)], dim=-1)  # [rows, 2I]
    activated = act_fn(gate_up[:, :512])  # [rows, I]
    want = activated * gate_up[:, 512:]
    got = decoder_layers.act_mul(gate_up, decoder_layers.activation_table(act_fn))
    tiny = torch.finfo(torch.float32).tiny
    normal = ~(activated.abs() < tiny) & ~((activated.float() * gate_up[:, 512:].float()).abs() < tiny)  # NaNs too
    assert normal.sum() > 48_000
    torch.testing.assert_close(got[normal], want[normal], rtol=0, atol=0, equal_nan=True)  # NaNs: PyTorch's own bits


@fused_run
def test_silu_mul_without_pytorchs_exp_stays_within_a_bf16_step():
    """Where PyTorch's exp cannot be reached, the kernel's own exp stands in: the same values up to a last bf16 bit."""
    library = decoder_layers._library()
    gate_up = (4 * torch.randn(5, 2 * 256, generator=torch.Generator().manual_seed(1))).bfloat16()
    want = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:]
    try:
        library.use_exp(None)
        got = decoder_layers.silu_mul(gate_up)
    finally:
        library.use_exp(bindings._torch_exp(bindings.LIBRARIES[decoder_layers.level()].torch_exp))
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    assert (got != want).float().mean() < 0.02
