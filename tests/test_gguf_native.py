"""Packed GGUF loading: block decoders against the `gguf` reference, the int4 linear, and a
tiny Qwen2 GGUF file written here, built packed and unpacked, and decoded speculatively."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn
from transformers import Qwen2Config

from conftest import activations_as_multiplied, tiny_config, tiny_model
from specdraft import ModelDrafter, SpecdraftError, SpeculativeDecoder
from specdraft.exactness import compare_greedy
from specdraft.kernels import (dense_matmul, gguf_matmul, int4_layout, isa, int8_codes, numerics, q4k_tiles,
                               tiles)
from specdraft.models.causal_lm import CausalLM
from specdraft.gguf_layout import Q4K_BLOCK_BYTES, Q6K_BLOCK_BYTES, QK_K
from specdraft.models.gguf_blocks import (dequantize, five_bit_affine, q4_affine, q4k_affine, q6k_unpack, split_affine,
                                          unpack_rows)
from specdraft.models.architectures import architecture_for
from specdraft.models.gguf_header import read_header
from specdraft.models.gguf_native import FlatLinear, PackedEmbedding, build_native_model
from specdraft.models.quantize import PASS_WIDTH, Int4Linear, SplitInt4Linear, int4_kernel_available, quantize_int4

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="no CPU int4 kernel in this PyTorch build")

Q4K, Q6K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0

# The tiny GGUF model: K-quants need in_features % 256 == 0.
HIDDEN, INTERMEDIATE, VOCAB, LAYERS, HEADS, KV_HEADS = 256, 512, 512, 2, 4, 2
KV_DIM = HIDDEN // HEADS * KV_HEADS


# ----- raw blocks ----------------------------------------------------------------------------
def fp16_bytes(values: np.ndarray) -> np.ndarray:  # [...] float -> [..., 2] uint8
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def pack_q4k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block `[..., 8]` as Q4_K's twelve bytes `[..., 12]`
    (llama.cpp's get_scale_min_k4, inverted)."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def random_q4k(rows: int, blocks: int, rng: np.random.Generator, d_range=(1e-3, 1e-2)) -> np.ndarray:
    """Random Q4_K bytes `[rows, blocks · 144]` with finite fp16 d and dmin."""
    raw = rng.integers(0, 256, (rows, blocks, Q4K_BLOCK_BYTES), dtype=np.uint8)  # [rows, nb, 144]
    raw[..., 0:2] = fp16_bytes(rng.uniform(*d_range, (rows, blocks)))  # d
    raw[..., 2:4] = fp16_bytes(rng.uniform(*d_range, (rows, blocks)))  # dmin
    return raw.reshape(rows, blocks * Q4K_BLOCK_BYTES)


def random_q6k(rows: int, blocks: int, rng: np.random.Generator, d_range=(1e-3, 1e-2)) -> np.ndarray:
    """Random Q6_K bytes `[rows, blocks · 210]` with a finite fp16 d."""
    raw = rng.integers(0, 256, (rows, blocks, Q6K_BLOCK_BYTES), dtype=np.uint8)  # [rows, nb, 210]
    raw[..., 208:210] = fp16_bytes(rng.uniform(*d_range, (rows, blocks)))  # d
    return raw.reshape(rows, blocks * Q6K_BLOCK_BYTES)


def encode_q4k(w: np.ndarray) -> np.ndarray:
    """A float matrix `[rows, K]` as Q4_K bytes `[rows, K / 256 · 144]`: a plain min/max
    encoder (valid, not llama.cpp's optimal one), so a test model has sensible weights."""
    rows, k = w.shape
    nb = k // QK_K
    groups = w.reshape(rows, nb, 8, 32).astype(np.float32)  # [rows, nb, sub, 32]
    low = np.minimum(groups.min(-1), 0.0)  # [rows, nb, 8]; Q4_K mins are subtracted, so low <= 0
    scale = np.maximum(groups.max(-1) - low, 1e-6) / 15  # [rows, nb, 8]
    d = (scale.max(-1) / 63).astype(np.float16)  # [rows, nb]
    dmin = (np.maximum((-low).max(-1), 1e-6) / 63).astype(np.float16)  # [rows, nb]
    sc = np.clip(np.round(scale / d[..., None]), 1, 63).astype(np.uint8)  # [rows, nb, 8]
    mn = np.clip(np.round(-low / dmin[..., None]), 0, 63).astype(np.uint8)  # [rows, nb, 8]
    step = (d.astype(np.float32)[..., None] * sc)[..., None]  # [rows, nb, 8, 1]
    offset = (dmin.astype(np.float32)[..., None] * mn)[..., None]  # [rows, nb, 8, 1]
    q = np.clip(np.round((groups + offset) / step), 0, 15).astype(np.uint8)  # [rows, nb, 8, 32]
    qs = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # [rows, nb, 4, 32]: sub-blocks 2p (low) and 2p+1 (high)
    raw = np.concatenate([fp16_bytes(d), fp16_bytes(dmin), pack_q4k_scales(sc, mn), qs.reshape(rows, nb, 128)], -1)
    return raw.reshape(rows, nb * Q4K_BLOCK_BYTES)


def gguf_values(raw: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    """gguf's reference dequantization of raw blocks, as float32."""
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, kind), dtype=np.float32))


# ----- the tiny GGUF file ----------------------------------------------------------------------
def layer_plan(i: int) -> dict[str, tuple[str, tuple[int, int]]]:
    """GGUF tensor -> (type, [out, in]) for layer i: Q4_K, Q6_K, Q8_0 and F16 mixed."""
    return {
        f"blk.{i}.attn_q.weight": ("Q4_K", (HIDDEN, HIDDEN)),
        f"blk.{i}.attn_k.weight": ("Q8_0", (KV_DIM, HIDDEN)),
        f"blk.{i}.attn_v.weight": ("Q6_K", (KV_DIM, HIDDEN)),
        f"blk.{i}.attn_output.weight": ("Q4_K" if i == 0 else "F16", (HIDDEN, HIDDEN)),
        f"blk.{i}.ffn_gate.weight": ("Q4_K", (INTERMEDIATE, HIDDEN)),
        f"blk.{i}.ffn_up.weight": ("Q8_0", (INTERMEDIATE, HIDDEN)),
        f"blk.{i}.ffn_down.weight": ("Q4_K", (HIDDEN, INTERMEDIATE)),
    }


def write_tiny_gguf(path, seed: int = 0, tied: bool = False) -> dict[str, str]:
    """A 2-layer Qwen2 GGUF at `path`; returns tensor name -> type name."""
    rng = np.random.default_rng(seed)
    plan = {"token_embd.weight": ("Q4_K", (VOCAB, HIDDEN))}
    for i in range(LAYERS):
        plan.update(layer_plan(i))
    if not tied:
        plan["output.weight"] = ("Q6_K", (VOCAB, HIDDEN))
    writer = GGUFWriter(str(path), "qwen2")
    for name, (kind, (rows, cols)) in plan.items():
        if kind == "Q4_K":
            writer.add_tensor(name, encode_q4k(rng.normal(0, 0.05, (rows, cols))), raw_dtype=Q4K)
        elif kind == "Q6_K":  # output: larger d, so logits have clear maxima
            d_range = (1e-3, 2e-3) if name == "output.weight" else (1e-4, 2e-4)
            writer.add_tensor(name, random_q6k(rows, cols // QK_K, rng, d_range), raw_dtype=Q6K)
        elif kind == "Q8_0":
            writer.add_tensor(name, gguf_quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), Q8_0),
                              raw_dtype=Q8_0)
        else:  # F16
            writer.add_tensor(name, rng.normal(0, 0.05, (rows, cols)).astype(np.float16))
    norms = [f"blk.{i}.{n}.weight" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")] + ["output_norm.weight"]
    for name in norms:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    biases = [(f"blk.{i}.{proj}.bias", width) for i in range(LAYERS)
              for proj, width in (("attn_q", HIDDEN), ("attn_k", KV_DIM), ("attn_v", KV_DIM))]
    for name, width in biases:
        writer.add_tensor(name, (0.1 * rng.standard_normal(width)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: kind for name, (kind, _) in plan.items()} | {name: "F32" for name in norms + [n for n, _ in biases]}


def linear_weights(kinds: dict[str, str]) -> dict[str, str]:
    """The linears' weights among a file's tensors (not the embedding, norms or biases): name -> type."""
    return {name: kind for name, kind in kinds.items()
            if name.endswith(".weight") and "norm" not in name and not name.startswith("token_embd")}


def gguf_config(tied: bool = False) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=tied,
    )


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The tiny model as a GGUF file with its own head, and a tied one (no output.weight)."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for tied in (False, True):
        path = root / ("tied.gguf" if tied else "model.gguf")
        files[tied] = (path, write_tiny_gguf(path, seed=0, tied=tied))
    return files


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def token_batches(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=generator) for n in (1, 7, 19)]  # [1, T]


BACKENDS = ("fallback", "native")  # Q6_K unpacked, or on our block kernel (Q4_K: the int4 kernel in both)


def build(path, config, dtype, backend: str, stacked: bool = True, **kwargs):
    """`build_native_model`, with the Q6_K block kernel switched off for the fallback backend (and, `stacked=False`,
    each projection left as its own module in transformers' class, where the tests look for it)."""
    with pytest.MonkeyPatch.context() as patch:
        if backend == "fallback":
            patch.setattr(gguf_matmul, "available", lambda: False)
        if not stacked:
            patch.setattr("specdraft.models.gguf_native.stack_layers", lambda *args: False)
            patch.setattr("specdraft.models.gguf_native.fast_decoder_layers", lambda model: 0)
        return build_native_model(path, config, dtype, **kwargs)


def expected_linear(type_name: str, backend: str, requantize: bool = False) -> type:
    """The module a GGUF linear of `type_name` should become (the loader's documented policy); `requantize`: in a
    draft as `prepare_draft` makes one (built with `split=False`, then `quantize_int4`)."""
    if requantize and type_name in ("Q5_K", "Q5_0"):  # a draft's 5-bit rows: unpacked for it, then re-quantized
        return Int4Linear
    if type_name in q4k_tiles.BITS:  # the file's blocks on the AVX2 and AVX-512 levels (a draft's Q4_K too), else 4-bit
        return q4k_tiles.Q4KLinear if q4k_tiles.available() else Int4Linear  # (Q5_K: 5-bit) tiles
    if type_name in q4k_tiles.GROUP_BITS:  # Q4_0, Q5_0: the same (Q5_0 elsewhere: 5-bit tiles)
        return q4k_tiles.Q40Linear if q4k_tiles.available() else Int4Linear
    if requantize and type_name in ("Q8_0", *dense_matmul.ELEMENT_BYTES):  # unpacked for it, then re-quantized
        return Int4Linear
    if type_name in int8_codes.TYPES:  # the file's codes on the AVX2 and AVX-512 levels, else two 4-bit halves
        return int8_codes.CodeLinear if int8_codes.available() else SplitInt4Linear
    if backend == "native" and type_name in gguf_matmul.BLOCK_BYTES:
        return gguf_matmul.BlockLinear
    if type_name in dense_matmul.ELEMENT_BYTES and dense_matmul.available():  # F16, BF16, F32 as stored
        return dense_matmul.DenseLinear
    return Int4Linear if requantize else FlatLinear


@pytest.fixture(scope="module")
def models(gguf_files):
    """`get(backend, tied, dtype, **kwargs)`: a model built from the tiny file, built once."""
    built = {}

    def get(backend: str = "fallback", tied: bool = False, dtype=torch.bfloat16, **kwargs):
        if backend == "native" and not gguf_matmul.available():
            pytest.skip("the Q6_K block kernel does not run here")
        key = (backend, tied, dtype, tuple(sorted(kwargs.items())))
        if key not in built:
            path = gguf_files[tied][0]
            built[key] = build(path, gguf_config(tied), dtype, backend, **kwargs)
        return built[key]
    return get


def reference_model(models, tied: bool = False):
    """Every weight unpacked to float32: the file's exact values."""
    return models("fallback", tied, torch.float32, pack=False)


# ----- 1. block decoders ---------------------------------------------------------------------------
def test_block_sizes_match_gguf():
    """Q4_K is d, dmin, 12 scale bytes and 128 code bytes (144); Q6_K is 128 + 64 + 16 + 2 (210)."""
    assert GGML_QUANT_SIZES[Q4K] == (QK_K, Q4K_BLOCK_BYTES) == (256, 2 + 2 + 12 + 128)
    assert GGML_QUANT_SIZES[Q6K] == (QK_K, Q6K_BLOCK_BYTES) == (256, 128 + 64 + 16 + 2)


def test_q4k_hand_built_block():
    """A Q4_K block with known d, dmin, 6-bit scales/mins (high bits used) and codes decodes to d·sc·q − dmin·m."""
    sc = np.array([3, 10, 17, 24, 31, 45, 52, 63], np.uint8)
    mn = np.array([60, 55, 50, 5, 40, 35, 18, 1], np.uint8)
    q = (np.arange(256) * 7 % 16).astype(np.uint8).reshape(8, 32)  # [sub, 32]
    block = np.concatenate([fp16_bytes(np.array(2.0)), fp16_bytes(np.array(0.5)), pack_q4k_scales(sc, mn),
                            (q[0::2] | (q[1::2] << 4)).reshape(128)])[None]  # [1, 144]
    expected = torch.from_numpy((2.0 * sc[:, None] * q - 0.5 * mn[:, None]).astype(np.float32).reshape(1, 256))
    codes, scale, minimum = q4k_affine(block)
    assert torch.equal(codes, torch.from_numpy(q.reshape(1, 256)))
    assert torch.equal(scale, torch.from_numpy(2.0 * sc[None].astype(np.float32)))
    assert torch.equal(minimum, torch.from_numpy(0.5 * mn[None].astype(np.float32)))
    assert torch.equal(gguf_values(block, Q4K), expected)


def test_q4k_affine_equals_gguf_reference():
    """Random Q4_K rows (3 super-blocks each): scale · codes − minimum is gguf's dequantization, bit for bit."""
    raw = random_q4k(rows=5, blocks=3, rng=np.random.default_rng(1))  # [5, 432]
    codes, scale, minimum = q4k_affine(raw)  # [5, 768] uint8, [5, 24], [5, 24]
    assert codes.dtype == torch.uint8 and codes.shape == (5, 768) and int(codes.max()) <= 15
    assert scale.shape == minimum.shape == (5, 24) and scale.dtype == torch.float32
    weights = (codes.view(5, 24, 32).float() * scale.unsqueeze(-1) - minimum.unsqueeze(-1)).view(5, 768)
    assert torch.equal(weights, gguf_values(raw, Q4K))
    assert torch.equal(unpack_rows(torch.from_numpy(raw), "Q4_K", 768), weights)


def test_q6k_unpack_equals_gguf_reference():
    """Random Q6_K rows (2 super-blocks each) decode exactly as gguf's reference does."""
    raw = random_q6k(rows=4, blocks=2, rng=np.random.default_rng(2))  # [4, 420]
    got = q6k_unpack(torch.from_numpy(raw))  # [4, 512]
    assert got.shape == (4, 512) and got.dtype == torch.float32
    assert torch.equal(got, gguf_values(raw, Q6K))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q4_affine_equals_gguf_reference(type_name):
    """Q4_0 and Q4_1 blocks as codes, scales and mins give gguf's dequantization bit for bit."""
    values = np.random.default_rng(4).normal(size=(6, 512)).astype(np.float32)
    raw = gguf_quantize(values, GGMLQuantizationType[type_name])
    codes, scale, minimum = q4_affine(torch.from_numpy(raw), type_name)  # [6, 512], [6, 16], [6, 16]
    weights = (codes.view(6, 16, 32).float() * scale.unsqueeze(-1) - minimum.unsqueeze(-1)).view(6, 512)
    assert int(codes.max()) <= 15 and torch.equal(weights, gguf_values(raw, GGMLQuantizationType[type_name]))


def random_q5k(rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q5_K bytes `[rows, blocks · 176]` with finite fp16 d and dmin."""
    raw = rng.integers(0, 256, (rows, blocks, 176), dtype=np.uint8)
    raw[..., 0:2] = fp16_bytes(rng.uniform(1e-3, 1e-2, (rows, blocks)))
    raw[..., 2:4] = fp16_bytes(rng.uniform(1e-3, 1e-2, (rows, blocks)))
    return raw.reshape(rows, blocks * 176)


def random_split_rows(type_name: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """A matrix in a `SPLIT_INTO_4BIT` type: gguf's quantizer where it has one, else random bytes with finite fp16
    d (Q5_K: dmin too; IQ4: of either sign, as llama.cpp's quantizer makes them, and the 6-bit IQ4_XS sub-block
    scales all over their range)."""
    if type_name == "Q5_K":
        return random_q5k(rows, columns // 256, rng)
    if not type_name.startswith("IQ4"):
        return gguf_quantize(rng.normal(size=(rows, columns)).astype(np.float32), GGMLQuantizationType[type_name])
    weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, columns // weights, block_bytes), dtype=np.uint8)
    raw[..., 0:2] = fp16_bytes(rng.choice([-1.0, 1.0], raw.shape[:2]) * rng.uniform(1e-3, 1e-2, raw.shape[:2]))
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"])
def test_split_halves_sum_to_gguf_reference(type_name):
    """5- and 8-bit codes (and the int8 values IQ4 nibbles stand for) split into two 4-bit affine halves whose sum is
    gguf's dequantization bit for bit."""
    rng = np.random.default_rng(5)
    kind = GGMLQuantizationType[type_name]
    raw = random_split_rows(type_name, 6, 512, rng)
    codes, scale, minimum = split_affine(torch.from_numpy(raw), type_name)  # [6, 1024], [6, 32], [6, 32]
    assert codes.shape == (6, 1024) and int(codes.max()) <= 15
    halves = (codes.view(6, 32, 32).float() * scale.unsqueeze(-1) - minimum.unsqueeze(-1)).view(6, 2, 512)
    assert torch.equal(halves.sum(1), gguf_values(raw, kind))


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K"])
def test_five_bit_codes_are_the_gguf_reference(type_name):
    """Q5_0, Q5_1 and Q5_K read as their own 5-bit codes (what 5-bit tiles hold): scale · codes − minimum is gguf's
    dequantization bit for bit."""
    rng = np.random.default_rng(7)
    kind = GGMLQuantizationType[type_name]
    raw = random_q5k(6, 2, rng) if type_name == "Q5_K" else gguf_quantize(
        rng.normal(size=(6, 512)).astype(np.float32), kind)
    codes, scale, minimum = five_bit_affine(torch.from_numpy(raw), type_name)  # [6, 512], [6, 16], [6, 16]
    assert codes.shape == (6, 512) and 16 <= int(codes.max()) <= 31
    weights = (codes.view(6, 16, 32).float() * scale.unsqueeze(-1) - minimum.unsqueeze(-1)).view(6, 512)
    assert torch.equal(weights, gguf_values(raw, kind))
    with pytest.raises(ValueError, match="5-bit codes are those of"):
        five_bit_affine(torch.from_numpy(gguf_quantize(rng.normal(size=(6, 64)).astype(np.float32),
                                                       GGMLQuantizationType.Q8_0)), "Q8_0")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_K", "IQ4_NL", "IQ4_XS"])
def test_split_linear_computes_the_files_weights(type_name):
    """A `SplitInt4Linear` computes x · Wᵀ of the file's weights within bf16 error, each token as it would alone."""
    rng = np.random.default_rng(6)
    kind = GGMLQuantizationType[type_name]
    raw = random_split_rows(type_name, 32, 512, rng)
    linear = SplitInt4Linear(Int4Linear.from_affine(*split_affine(torch.from_numpy(raw), type_name)))
    assert (linear.in_features, linear.out_features) == (512, 32)
    weight = gguf_values(raw, kind)  # [32, 512]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = linear(x)  # [5, 32]
    assert relative_error(got, x.float() @ weight.t()) < 2e-2
    assert relative_error(linear.dequantized_weight(), weight) < 1e-2  # the scales rounded to bf16
    assert torch.equal(linear(x[2:3]), got[2:3])


def test_dequantize_wraps_gguf_reference():
    """`dequantize` gives gguf's values in the logical shape, for a type decoded only by gguf (Q8_0)."""
    values = np.random.default_rng(3).normal(size=(6, 64)).astype(np.float32)
    raw = gguf_quantize(values, Q8_0)  # [6, 68]
    got = dequantize(raw, "Q8_0", (6, 64))
    assert got.shape == (6, 64) and torch.equal(got, gguf_values(raw, Q8_0))
    assert torch.allclose(got, torch.from_numpy(values), atol=0.05)


def test_corrupted_scale_byte_changes_its_row_only():
    """Negative control: flipping bits of one scale byte changes the decoded row it lies in, nothing else."""
    rng = np.random.default_rng(4)
    cases = (("Q4_K", random_q4k(3, 2, rng), 4), ("Q6_K", random_q6k(3, 2, rng), 192))  # first scale byte
    for kind, raw, scale_byte in cases:
        bad = raw.copy()
        bad[1, scale_byte] ^= 0x05
        good_rows = unpack_rows(torch.from_numpy(raw), kind, 512)  # [3, 512]
        bad_rows = unpack_rows(torch.from_numpy(bad), kind, 512)  # [3, 512]
        assert not torch.equal(good_rows[1], bad_rows[1])
        assert torch.equal(good_rows[[0, 2]], bad_rows[[0, 2]])


# ----- 2. Int4Linear -------------------------------------------------------------------------------
def affine_parts(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes `[n, k]` (0..15), scale and minimum `[n, k / 32]`, bias `[n]`."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale = 1e-3 + 9e-3 * torch.rand(n, k // 32, generator=generator)
    minimum = 0.1 * torch.rand(n, k // 32, generator=generator) - 0.03
    bias = torch.randn(n, generator=generator)
    return codes, scale, minimum, bias


def affine_weight(codes, scale, minimum) -> torch.Tensor:  # -> [n, k] float32, w = scale · codes − minimum
    n = codes.shape[0]
    return (codes.view(n, -1, 32).float() * scale.unsqueeze(-1) - minimum.unsqueeze(-1)).view(n, -1)


def test_int4_dequantized_weight_is_the_affine_weight():
    """from_affine computes scale·codes − minimum, up to bf16 rounding of scale, zero and the result."""
    codes, scale, minimum, bias = affine_parts(48, 128, seed=0)  # N multiple of 16, K of 32
    linear = Int4Linear.from_affine(codes, scale, minimum, bias)
    want = affine_weight(codes, scale, minimum)  # [48, 128]
    got = linear.dequantized_weight()  # [48, 128]
    assert got.shape == want.shape and linear.group_size == 32
    # (q − 8)·bf16(scale) + bf16(zero), rounded to bf16: each rounding costs at most 2^-8 relative.
    zero = 8 * scale - minimum  # [48, 4]
    bound = 2 ** -8 * (8 * scale + zero.abs() + want.abs().view(48, 4, 32).amax(-1)) + 1e-7  # [48, 4]
    assert ((got - want).abs().view(48, 4, 32) <= bound.unsqueeze(-1)).all()
    assert not torch.equal(Int4Linear.from_affine(codes ^ 1, scale, minimum).dequantized_weight(), got)


@pytest.mark.parametrize("tokens", [1, 3, PASS_WIDTH + 5])
def test_int4_forward_matches_float(tokens):
    """forward(x) is x W^T + b within bf16 error, for a narrow, a small and a sliced wide pass."""
    codes, scale, minimum, bias = affine_parts(64, 256, seed=1)
    linear = Int4Linear.from_affine(codes, scale, minimum, bias)
    x = torch.randn(1, tokens, 256, generator=torch.Generator().manual_seed(tokens))  # [1, T, K]
    got = linear(x)  # [1, T, N]
    want = x @ affine_weight(codes, scale, minimum).t() + bias  # [1, T, N]
    assert got.shape == (1, tokens, 64) and got.dtype == x.dtype
    assert relative_error(got, want) < 1e-2


def test_int4_wide_pass_equals_its_slices():
    """A pass wider than PASS_WIDTH equals its PASS_WIDTH-token slices run one by one, exactly."""
    linear = Int4Linear.from_affine(*affine_parts(32, 64, seed=2))
    x = torch.randn(2 * PASS_WIDTH + 3, 64, generator=torch.Generator().manual_seed(2))  # [T, K]
    slices = [linear(x[i:i + PASS_WIDTH]) for i in range(0, x.shape[0], PASS_WIDTH)]  # [<= PASS_WIDTH, N] each
    assert torch.equal(linear(x), torch.cat(slices))


def test_int4_kept_dense_weight_serves_wide_passes():
    """quantize(keep_dense=True): wide passes use the dense weight exactly, narrow ones the lossy kernel.
    (bf16, as drafts run: the module keeps its bias in bf16, so a float32 one would be rounded.)"""
    torch.manual_seed(3)
    dense = nn.Linear(64, 32).to(torch.bfloat16)
    linear = Int4Linear.quantize(dense, keep_dense=True)
    wide, narrow = torch.randn(PASS_WIDTH + 1, 64).bfloat16(), torch.randn(2, 64).bfloat16()  # [T, K]
    assert torch.equal(linear(wide), dense(wide).detach())
    assert relative_error(linear(narrow), dense(narrow).detach()) < 0.15  # 4-bit min/max groups: ~7%
    assert not torch.equal(linear(narrow), dense(narrow).detach())


@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 16, 17, 40])
def test_q6k_tiles_compute_the_files_weights(tile_kernel, tokens):
    """Random Q6_K rows repacked into tiles: x · W^T with W the reference decoding, to float32 rounding
    (x as the kernel takes it: bf16 on AMX and AVX-512 bf16, the int16 grid on AVX-512 int16), and each token
    the same alone or in a pass (past each kernel's pass of 8 or 16 tokens too)."""
    kernel = tile_kernel
    raw = torch.from_numpy(random_q6k(48, 3, np.random.default_rng(tokens)))  # [48, 630]
    weight = q6k_unpack(raw)  # [48, 768]
    packed = gguf_matmul.pack_q6k(raw, kernel.layout)
    assert packed.tiles.numel() == 48 * 768 * 13 // 16  # 6.5 bits a weight, as in the file
    x = torch.randn(tokens, 768, generator=torch.Generator().manual_seed(tokens)).bfloat16()  # [T, K]
    got = kernel.q6k_matmul(packed.tiles, packed.d, x, 48)  # [T, N]
    want = activations_as_multiplied(x, kernel) @ weight.double().t()
    assert got.dtype == torch.float32 and relative_error(got.double(), want) < 1e-6
    assert relative_error(got.double(), x.double() @ weight.double().t()) < 1e-4  # the grid is fine
    for i in range(tokens):
        assert torch.equal(kernel.q6k_matmul(packed.tiles, packed.d, x[i:i + 1], 48)[0], got[i])
    with pytest.raises(ValueError, match="N % 16"):
        gguf_matmul.pack_q6k(raw[:40])


@pytest.mark.parametrize("type_name", ["F16", "BF16", "F32"])
@pytest.mark.parametrize("tokens", [1, 2, 6, 7, 13])
def test_dense_tiles_compute_the_files_weights(tile_kernel, type_name, tokens):
    """F16, BF16 and F32 rows as stored, in dense tiles: x · W^T with W the file's own values (no bf16 rounding) and x as the
    model holds it (bf16), to float32 rounding, and each token the same alone or in a pass (passes of one sweep, of
    several, and one token over whole and partial groups of blocks: 5 blocks of 16 rows)."""
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[type_name]
    weight = torch.randn(80, 95, generator=torch.Generator().manual_seed(tokens)).to(dtype)  # [N, K]
    packed = dense_matmul.pack_dense(weight.view(torch.uint8).view(80, -1), type_name)
    assert packed.tiles.numel() == weight.numel() * weight.element_size()  # the file's bytes, reordered
    x = torch.randn(tokens, 95, generator=torch.Generator().manual_seed(7)).bfloat16()  # [T, K]
    got = tile_kernel.dense_matmul(packed.tiles, type_name, x, 80)  # [T, N]
    want = x.double() @ weight.double().t()
    assert got.dtype == torch.float32 and relative_error(got.double(), want) < 1e-6
    if type_name == "F32":  # bf16 weights would be off by ~1e-3
        assert relative_error(got.double(), x.double() @ weight.bfloat16().double().t()) > 1e-4
    for i in range(tokens):
        assert torch.equal(tile_kernel.dense_matmul(packed.tiles, type_name, x[i:i + 1], 80)[0], got[i])
    with pytest.raises(ValueError, match="N % 16"):
        dense_matmul.pack_dense(weight[:40].view(torch.uint8).view(40, -1), type_name)


@pytest.mark.parametrize("kernel", [tiles.AVX2, tiles.AVX512, tiles.AMX, None], ids=["avx2", "avx512", "amx", "torch"])
def test_dense_types_run_on_the_dense_kernel_on_avx2_and_avx512(kernel, gguf_files, monkeypatch):
    """F16 linears are built dense where the AVX2 or AVX-512 tile kernel runs (on a Zen 4 twice as fast as PyTorch's
    bf16 linears end to end), else unpacked for PyTorch's bf16 linears (AMX: its bf16 tiles; PyTorch's level)."""
    monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)
    dense = kernel in (tiles.AVX2, tiles.AVX512)
    assert dense_matmul.available() == dense
    if kernel is not tiles.AVX2:
        monkeypatch.setattr(gguf_matmul, "available", lambda: False)  # no other kernel runs here to build them on
        monkeypatch.setattr("specdraft.models.gguf_native.int4_kernel_available", lambda: False)
    path, kinds = gguf_files[False]
    model = build(path, gguf_config(False), torch.bfloat16, "native", stacked=False)
    f16 = [name for name, kind in linear_weights(kinds).items() if kind == "F16"]
    want = dense_matmul.DenseLinear if dense else FlatLinear
    assert f16 and all(type(model.get_submodule(module_path(name)[0])) is want for name in f16)


def test_q6k_quads_layout_holds_the_files_bits():
    """`QUADS` Q6_K tiles: the nibbles as 4-bit `QUADS` tiles lay them out, and byte 256 + 32·j + 4·c + b of a tile the
    top two bits of (row c, input 8j + b), (c, 8j + 4 + b), (8 + c, 8j + b), (8 + c, 8j + 4 + b), from bit 0 up."""
    raw = torch.from_numpy(random_q6k(32, 2, np.random.default_rng(5)))  # [32, 420]: K = 512
    weight = q6k_unpack(raw)  # [32, 512]
    packed = gguf_matmul.pack_q6k(raw, int4_layout.QUADS)
    tiles_ = packed.tiles.view(2, 16, 416)  # [row blocks, groups, bytes]
    pairs = gguf_matmul.pack_q6k(raw, int4_layout.PAIRS)
    assert torch.equal(packed.d, pairs.d) and torch.equal(packed.tiles.view(2, 16, 416)[..., 384:],
                                                          pairs.tiles.view(2, 16, 416)[..., 384:])  # scales as they were
    # codes from the tiles, rebuilt by the layout's rule, give the weights back with the scales
    low = torch.empty(32, 512, dtype=torch.int64)
    for block in range(2):
        for group in range(16):
            tile = tiles_[block, group].tolist()
            for j in range(4):
                for h in range(2):
                    for c in range(8):
                        for b in range(4):
                            byte, high = tile[64 * j + 32 * h + 4 * c + b], tile[256 + 32 * j + 4 * c + b]
                            row, column = 16 * block + 8 * h + c, 32 * group + 8 * j + b
                            low[row, column] = (byte & 0x0F) | (((high >> (4 * h)) & 0x03) << 4)
                            low[row, column + 4] = (byte >> 4) | (((high >> (4 * h + 2)) & 0x03) << 4)
    scales = tiles_[..., 384:].contiguous().view(torch.int8).view(2, 16, 2, 16).float()  # [block, group, sub-block, row]
    d = packed.d.repeat_interleave(8, dim=1)  # [block, group, row]
    s_ = (scales * d.unsqueeze(2)).permute(0, 3, 1, 2).reshape(32, 32).repeat_interleave(16, dim=1)  # [N, K]
    assert torch.equal((s_ * (low.float() - 32)), weight.float())


@pytest.mark.skipif(not gguf_matmul.available(), reason="the Q6_K tile kernel does not run here")
@pytest.mark.parametrize("level", ["amx", "avx512", "avx2"])
def test_q6k_linears_take_the_fastest_kernel_the_isa_allows(level, monkeypatch):
    """AMX where granted, else AVX-512, else AVX2; `SPECDRAFT_ISA` forces a lower level on a bigger CPU."""
    if not isa.CPU_FLAGS[level] <= isa.cpu_flags():
        pytest.skip(f"this CPU has no {level}")
    monkeypatch.setenv(numerics.ISA_VARIABLE, level)
    raw = torch.from_numpy(random_q6k(16, 1, np.random.default_rng(0)))
    x = torch.randn(2, 256).bfloat16()
    kernel = next(k for k in tiles.KERNELS if numerics.current().allows(k.level) and k.library())
    assert tiles.tile_kernel() is kernel
    packed = gguf_matmul.pack_q6k(raw, kernel.layout)
    assert torch.equal(gguf_matmul.block_matmul(packed, x), kernel.q6k_matmul(packed.tiles, packed.d, x, 16))
    other = int4_layout.QUADS if kernel.layout == int4_layout.PAIRS else int4_layout.PAIRS
    with pytest.raises(ValueError, match=f"reads {kernel.layout} tiles; the matrix was packed as {other}"):
        gguf_matmul.block_matmul(gguf_matmul.pack_q6k(raw, other), x)


# ----- 3. the tiny GGUF model ------------------------------------------------------------------------
def module_path(gguf_name: str) -> tuple[str, str]:
    """Where the tiny Qwen2 file's tensor goes."""
    return architecture_for(gguf_config()).module_path(gguf_name)


def test_module_path_names():
    """GGUF names map to transformers module paths; frequency factors are no module; an unknown name is a KeyError."""
    assert module_path("blk.3.attn_q.bias") == ("model.layers.3.self_attn.q_proj", "bias")
    assert module_path("blk.0.ffn_norm.weight") == ("model.layers.0.post_attention_layernorm", "weight")
    assert module_path("token_embd.weight") == ("model.embed_tokens", "weight")
    assert module_path("output.weight") == ("lm_head", "weight")
    assert module_path("rope_freqs.weight") is None
    for name in ("blk.0.attn_qkv.weight", "blk.0.attn_q.weight.extra", "blk.0.post_ffw_norm.weight"):
        with pytest.raises(KeyError):
            module_path(name)


def test_unexpected_tensor_is_reported(tmp_path):
    """A file with a tensor its family does not have is refused, naming the tensor and the way out."""
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.attn_qkv.weight", np.zeros((3 * HIDDEN, HIDDEN), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecdraftError, match="Unexpected tensor 'blk.0.attn_qkv.weight' for a qwen2 model.*unpacked"):
        build_native_model(path, gguf_config(), torch.bfloat16)


def test_header_reads_what_gguf_py_reads(gguf_files):
    """Our one-pass header reader gives gguf-py's tensor table (names, types, shapes outermost first, absolute
    offsets, byte counts) and metadata values; string arrays hold their length unless asked for."""
    from gguf import GGUFReader

    path, kinds = gguf_files[False]
    header = read_header(path)
    reader = GGUFReader(str(path))
    assert [(e.name, e.type_name, e.shape, e.offset, e.n_bytes) for e in header.tensors] == [
        (t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors]
    assert {e.name: e.type_name for e in header.tensors} == kinds
    assert next(e for e in header.tensors if e.name == "blk.0.ffn_down.weight").shape == (HIDDEN, INTERMEDIATE)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        if isinstance(want, list) and want and isinstance(want[0], str):
            assert header.get(key) == len(want), key
            assert read_header(path, string_arrays=True).get(key) == want, key
        else:
            assert header.get(key) == pytest.approx(want), key


def test_unpacked_weights_are_the_files_values(gguf_files, models):
    """pack=False float32 holds exactly gguf's dequantization of every tensor (embedding rows included)."""
    from gguf import GGUFReader

    model = reference_model(models)
    for tensor in GGUFReader(str(gguf_files[False][0])).tensors:
        want = torch.from_numpy(np.array(gguf_dequantize(tensor.data, tensor.tensor_type), np.float32))
        module_name, param = module_path(tensor.name)
        module = model.get_submodule(module_name)
        if isinstance(module, PackedEmbedding):
            got = module(torch.arange(VOCAB))  # [vocab, hidden]
        else:
            got = getattr(module, param)
        assert got.dtype == torch.float32 and torch.equal(got, want.view(got.shape)), tensor.name


def test_embedding_lookups_read_the_files_rows_and_map_none_of_it(gguf_files, models):
    """Looked-up rows (repeated, out of order, in a batch) are the file's rows; the file is never mapped into the
    process (a mapped table grew it by whole large folios); an id outside the table is an error, not a stray read."""
    embedding = reference_model(models).model.embed_tokens
    table = embedding(torch.arange(VOCAB))  # [vocab, hidden]
    ids = torch.tensor([[5, 3, 5, VOCAB - 1], [0, 4, 3, 2]])
    assert torch.equal(embedding(ids), table[ids])
    assert embedding(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, table.shape[1])
    path = str(gguf_files[False][0])
    assert not any(line.rstrip().endswith(path) for line in open("/proc/self/maps"))
    with pytest.raises(IndexError, match="token ids"):
        embedding(torch.tensor([VOCAB]))
    assert torch.equal(copy.deepcopy(embedding)(ids), table[ids])  # a copy opens the file anew


def test_single_token_lookups_keep_recent_rows_as_copies(gguf_files, models, monkeypatch):
    """A decoding step's one token gets the file's row whether it was kept or read anew; the caller owns what it gets
    (a write into it reaches no later lookup); at most RECENT_ROWS rows are kept, the least recently asked dropped."""
    import specdraft.models.gguf_native as gguf_native

    monkeypatch.setattr(gguf_native, "RECENT_ROWS", 2)
    embedding = reference_model(models).model.embed_tokens
    table = embedding(torch.arange(VOCAB))  # [vocab, hidden]
    for token in (5, 3, 5, 7, 5, VOCAB - 1, 3):
        row = embedding(torch.tensor([[token]]))  # [1, 1, hidden]
        assert row.shape == (1, 1, table.shape[1]) and torch.equal(row[0, 0], table[token])
        row.fill_(1e4)  # the fused layers write the residual stream into it
        assert len(embedding._recent) <= 2
    assert list(embedding._recent) == [VOCAB - 1, 3]
    assert torch.equal(embedding(torch.tensor([3])), table[3:4])
    with pytest.raises(IndexError, match="token ids"):
        embedding(torch.tensor([[VOCAB]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_modules_follow_the_tensor_types(gguf_files, models, backend):
    """Q4_K (and Q6_K with the block kernel) stay packed, the rest are FlatLinear; the embedding stays packed."""
    model, kinds = models(backend, stacked=False), gguf_files[False][1]
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    for name, kind in linear_weights(kinds).items():
        assert type(model.get_submodule(module_path(name)[0])) is expected_linear(kind, backend), name
    reference = reference_model(models)
    assert all(type(m) is FlatLinear for n, m in reference.named_modules() if n.endswith(("proj", "lm_head")))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_logits_match_reference(models, backend, tied):
    """The packed bf16 model's logits are the float32 reference's within bf16 error (own head or tied)."""
    packed, reference = models(backend, tied), reference_model(models, tied)
    with torch.inference_mode():
        for ids in token_batches():  # [1, T]
            got, want = packed(ids).logits, reference(ids).logits  # [1, T, V]
            assert got.shape == want.shape == (1, ids.shape[1], VOCAB)
            assert relative_error(got, want) < 2e-2


def test_tied_head_is_built_from_the_embedding(models):
    """A file without output.weight gets an lm_head holding token_embd's values, separate from the embedding."""
    reference = reference_model(models, tied=True)
    embedding = reference.model.embed_tokens(torch.arange(VOCAB))  # [vocab, hidden]
    assert torch.equal(reference.lm_head.weight, embedding)
    assert not torch.equal(reference_model(models).lm_head.weight, reference.lm_head.weight)
    assert reference.config.tie_word_embeddings is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_int4_draft_from_a_packed_file(gguf_files, models, backend):
    """A draft's int4 pass (`quantize_int4`) re-quantizes the unpacked linears too: lossy, yet mostly the same argmax."""
    if backend == "native" and not gguf_matmul.available():
        pytest.skip("the Q6_K block kernel does not run here")
    kinds = gguf_files[False][1]
    model = build(gguf_files[False][0], gguf_config(False), torch.bfloat16, backend, stacked=False, split=False)
    assert quantize_int4(model) > 0
    for name, kind in linear_weights(kinds).items():
        assert type(model.get_submodule(module_path(name)[0])) is expected_linear(kind, backend, requantize=True), name
    reference = reference_model(models)
    agree = []
    with torch.inference_mode():
        for ids in token_batches(seed=1):  # [1, T]
            agree += (model(ids).logits.argmax(-1) == reference(ids).logits.argmax(-1)).flatten().tolist()
    assert sum(agree) >= 0.5 * len(agree)  # ~0.7 seen; unrelated weights would agree ~1/512


@pytest.mark.parametrize("code_tiles", [True, False], ids=["code-tiles", "halves"])
def test_packed_model_counts_each_weight_once(gguf_files, models, monkeypatch, code_tiles):
    """The packed model counts the weights of the model unpacked from the same file: a Q8_0 linear in its own tiles
    (the AVX2 level) or split into two 4-bit halves (elsewhere) is one matrix's weights, not three."""
    from specdraft.models.causal_lm import CausalLM

    if not code_tiles:
        monkeypatch.setattr(int8_codes, "available", lambda: False)
    packed = build(gguf_files[False][0], gguf_config(False), torch.bfloat16, "fallback", stacked=False)
    q8_0_module = int8_codes.CodeLinear if code_tiles and int8_codes.available() else SplitInt4Linear
    assert any(isinstance(m, q8_0_module) for m in packed.modules())
    assert CausalLM(packed).num_parameters() == CausalLM(reference_model(models)).num_parameters()


def test_kept_packed_model_is_the_built_one(gguf_files, tmp_path, monkeypatch, capsys):
    """A model read back from its kept modules computes the first build's logits bit for bit and keeps transformers'
    hidden-state capture; the second build converts nothing; an unreadable kept file is built again, with a warning."""
    from specdraft.models import gguf_native

    path, config = gguf_files[True][0], gguf_config(True)
    kept = tmp_path / "kept.pt"
    first = build_native_model(path, config, torch.bfloat16, kept=kept)
    assert kept.is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the file was converted again")
    with monkeypatch.context() as patch:
        patch.setattr(gguf_native, "_file_modules", no_conversion)
        again = build_native_model(path, config, torch.bfloat16, kept=kept)
    ids = token_batches()[0]
    with torch.inference_mode():
        want, got = first(ids, output_hidden_states=True), again(ids, output_hidden_states=True)
    assert torch.equal(got.logits, want.logits)
    assert got.hidden_states is not None and torch.equal(got.hidden_states[-1], want.hidden_states[-1])
    kept.write_bytes(kept.read_bytes()[:1000])  # cut
    rebuilt = build_native_model(path, config, torch.bfloat16, kept=kept)
    assert "packing again" in capsys.readouterr().err
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids).logits, want.logits)


def _mapped_resident_bytes(path) -> int:
    """How much of the file at `path` this process's mappings of it hold resident (/proc/self/smaps)."""
    resident, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:  # a mapping's first line: "start-end perms offset dev inode path"
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            resident += int(line.split()[1]) * 1024
    return resident


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc")
def test_dropping_a_mapped_tensors_pages_gives_them_back_and_changes_no_bytes(tmp_path):
    """A kept model is read mapped (`packed_store.read`); the tensors the stacking replaces give their pages back
    (`heap.drop_file_pages`) where they would stay resident while the mapping lives. Only they do: a neighbour keeps
    its pages, a dropped tensor still reads its bytes (from the file again), and memory that is not a file's is left."""
    from specdraft.models.heap import drop_file_pages

    want = {"dropped": torch.arange(2 << 20, dtype=torch.int32), "kept": torch.arange(2 << 20, dtype=torch.int32) * 3}
    path = tmp_path / "kept.pt"
    torch.save(want, path)
    mapped = torch.load(path, mmap=True)
    assert all(int(t.sum()) == int(want[name].sum()) for name, t in mapped.items())  # every page touched
    before = _mapped_resident_bytes(path)
    drop_file_pages([mapped["dropped"]])
    after = _mapped_resident_bytes(path)
    assert before - after >= (8 << 20) - 2 * 4096, (before, after)  # the dropped tensor's 8 MB, to whole pages
    assert after >= (8 << 20) - 4096  # the neighbour's stay
    assert torch.equal(mapped["dropped"], want["dropped"]) and torch.equal(mapped["kept"], want["kept"])
    anonymous = torch.arange(2 << 20, dtype=torch.int32)
    drop_file_pages([anonymous])
    assert torch.equal(anonymous, want["dropped"])


def test_truncated_file_is_reported(gguf_files, tmp_path):
    """A file cut short raises SpecdraftError naming truncation, with or without a kept tensor index."""
    path = gguf_files[False][0]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SpecdraftError, match="truncated"):  # the header is whole: the tensor reads find the cut
        build_native_model(cut, gguf_config(), torch.bfloat16)
    embedding = next(e for e in read_header(path).tensors if e.name == "token_embd.weight")
    cut.write_bytes(path.read_bytes()[:embedding.offset + 10])  # cut inside the mapped embedding table
    with pytest.raises(SpecdraftError, match="ends inside tensor 'token_embd.weight'"):
        build_native_model(cut, gguf_config(), torch.bfloat16)
    cut.write_bytes(path.read_bytes()[:200])  # cut inside the header
    with pytest.raises(SpecdraftError, match="truncated or corrupt"):
        read_header(cut)


def test_flat_linear_takes_strided_inputs():
    """FlatLinear gives nn.Linear's result on a strided 3-D slice (the LM head's last positions)."""
    torch.manual_seed(4)
    flat = FlatLinear(32, 48)
    x = torch.randn(2, 5, 32)[:, -2:]  # [2, 2, K], not contiguous
    assert flat(x).shape == (2, 2, 48)
    assert torch.allclose(flat(x), nn.functional.linear(x, flat.weight, flat.bias), atol=1e-6)


# ----- 4. speculative decoding on the packed model -----------------------------------------------------
PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(10, 40))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_speculative_equals_plain_on_packed_model(models, backend):
    """Greedy speculative decoding of the packed target (close and unrelated drafts) emits plain decoding's tokens:
    exactly where every linear runs on our kernels (`native` on AVX2: 4-bit, Q8_0, Q6_K and dense F16 tiles), else
    parting from them only at a near-tie (`fallback`: its Q6_K linears on PyTorch's bf16 GEMM, whose roundings depend
    on the pass width; seen: logits 0.5-0.75 apart between a one-token and a four-token pass). This model's logits
    are near 100, where a bf16 step is 0.5: a near-tie is two steps."""
    packed = models(backend)
    drafts = {"close": reference_model(models), "unrelated": tiny_model(tiny_config(vocab_size=VOCAB), seed=5)}
    plain = SpeculativeDecoder(CausalLM(packed))
    accepted = {}
    for name, draft in drafts.items():
        spec = SpeculativeDecoder(CausalLM(packed), ModelDrafter(CausalLM(draft), min_confidence=0.0), k=3)
        accepted[name] = 0
        for prompt in PROMPTS:
            want = plain.generate(prompt, max_new_tokens=20)
            got = spec.generate(prompt, max_new_tokens=20)
            verdict = compare_greedy(CausalLM(packed), prompt, want.token_ids, got.token_ids, margin=1.0)
            assert verdict.acceptable, (name, prompt, verdict)
            if backend == "native" and gguf_matmul.available() and dense_matmul.available():
                assert got.token_ids == want.token_ids, (name, prompt)
            assert got.stats.new_tokens == 20 and got.stats.drafted > 0
            accepted[name] += got.stats.accepted
    assert accepted["close"] > accepted["unrelated"]


def test_a_draft_to_requantize_gets_its_8_bit_linears_unpacked(gguf_files):
    """`split=False` (a draft `prepare_draft` re-quantizes) unpacks Q8_0 instead of splitting it into 4-bit halves,
    and F16 instead of keeping it dense, so re-quantization gives plain 4-bit linears (a half or a quarter of the
    bytes a pass); Q4_K stays the file's own."""
    path, kinds = gguf_files[False]
    model = build(path, gguf_config(False), torch.bfloat16, "native", stacked=False, split=False)
    unpacked = [name for name, kind in linear_weights(kinds).items() if kind in ("Q8_0", "F16")]
    assert {linear_weights(kinds)[name] for name in unpacked} == {"Q8_0", "F16"}
    assert all(type(model.get_submodule(module_path(name)[0])) is FlatLinear for name in unpacked)
    quantize_int4(model)
    assert all(type(model.get_submodule(module_path(name)[0])) is Int4Linear for name in unpacked)
