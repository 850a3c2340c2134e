"""Random GGUF files (`bench.random_gguf`): written in llama.cpp's layout, read back by transformers'
GGUF loader to the same values, K-quant encoders that gguf-py decodes, llama.cpp's own type mixes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specdraft.models.gguf_config import gguf_config, llama3_rope_factors
from specdraft.models.gguf_native import build_native_model
from specdraft.models.loading import _refuse_unread_frequency_factors
import torch

from specdraft import SpecdraftError
from specdraft.bench import random_gguf
from specdraft.models.gguf_header import read_header
from specdraft.bench.random_gguf import (FAMILIES, encode, file_reference, preset_types, random_model,
                                        tiny_config, tokenizer_fields, write_gguf, write_random_gguf)

# Relative RMS error of a weight read back, per preset: far below the ~1.0 a wrong row order or a
# missing norm offset gives. F32 is exact but for Gemma's norms ((w + 1) - 1 rounds in float32).
TOLERANCE = {"F32": 1e-6, "Q4_K_M": 0.12, "Q5_K_M": 0.06, "Q4_0": 0.12}
PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13, 200, 300, 17, 19, 21, 23]])  # longer than the tiny sliding window (8)


def read_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("preset", sorted(TOLERANCE))
def test_transformers_reads_back_the_values(family, preset, tmp_path):
    """q/k un-permutation, Gemma's `1 + w`, fused Phi-3 tensors, tied output, config: F32 gives the same
    weights and logits, quantized presets are within their quantization error."""
    model = random_model(tiny_config(family), seed=1)
    path = write_gguf(model, tmp_path / f"{family}.gguf", preset)
    reference = file_reference(path)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name, values in ours.items():
        error = (theirs[name] - values).pow(2).mean().sqrt() / values.pow(2).mean().sqrt()
        assert error <= TOLERANCE[preset], f"{name}: relative error {error:.3f}"
    if preset == "F32":
        with torch.no_grad():
            torch.testing.assert_close(model(PROMPT).logits, reference(PROMPT).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_tied_embeddings(family, tmp_path):
    """A tied model writes no `output.weight`; Q4_K_M then puts the embedding in Q6_K, as llama.cpp does."""
    model = random_model(tiny_config(family, tie_word_embeddings=True), seed=0)
    path = write_gguf(model, tmp_path / "tied.gguf", "Q4_K_M")
    types = read_types(path)
    assert "output.weight" not in types and types["token_embd.weight"] == "Q6_K"
    assert file_reference(path).config.tie_word_embeddings


def test_random_model_is_the_streamed_file(tmp_path):
    """`random_model` then `write_gguf` and `write_random_gguf` (tensor by tensor) write the same bytes."""
    config = tiny_config("llama")
    a = write_gguf(random_model(config, seed=3), tmp_path / "a.gguf", "Q4_K_M")
    b = write_random_gguf(config, tmp_path / "b.gguf", "Q4_K_M", seed=3)
    assert a.read_bytes() == b.read_bytes()


def test_llama3_rope_scaling_is_a_rope_freqs_tensor(tmp_path):
    """Llama 3's rope scaling goes in `rope_freqs`; `file_reference` recovers it, so logits match."""
    config = tiny_config("llama", rope_parameters={**random_gguf.LLAMA_32_ROPE, "original_max_position_embeddings": 64})
    odd = write_random_gguf(config, tmp_path / "odd.gguf", "F32")  # factors of no published scaling
    read = gguf_config(odd)
    assert read.rope_parameters.get("rope_type", "default") == "default"  # only Llama 3's own are recovered ...
    packed = build_native_model(odd, read, torch.float32)  # ... and the packed loader divides by the factors
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    base = LlamaRotaryEmbedding(config=read).inv_freq  # transformers' table, without the factors
    factors = llama3_rope_factors(64, config.rope_parameters)
    assert torch.allclose(packed.model.rotary_emb.inv_freq, base / factors)
    with pytest.raises(SpecdraftError, match="rope_freqs.*Load it packed"):  # transformers would ignore them
        _refuse_unread_frequency_factors(odd, read)
    config = tiny_config("llama", rope_parameters=dict(random_gguf.LLAMA_32_ROPE))
    model = random_model(config, seed=0)
    path = write_gguf(model, tmp_path / "rope.gguf", "F32")
    assert read_types(path)["rope_freqs.weight"] == "F32"
    reference = file_reference(path)
    assert reference.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, reference(PROMPT).logits)


# ----- K-quant encoders ------------------------------------------------------------------------
def hard_matrix() -> np.ndarray:  # [8, 512]: random rows, a zero row, a constant block, an outlier, one sign
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 512)) * 0.1).astype(np.float32)
    w[1] = 0.0
    w[2, :256] = 5.0
    w[3, 7] = 3.0
    w[4] = np.abs(w[4])
    w[5] = -np.abs(w[5])
    return w


@pytest.mark.parametrize("type_name, tolerance", [("Q4_K", 0.09), ("Q5_K", 0.045), ("Q6_K", 0.025)])
def test_k_quant_encoders_decode_with_gguf(type_name, tolerance):
    """Each row decodes (gguf.quants.dequantize) to within half a quantization step of its range."""
    w = hard_matrix()
    raw = encode(w, type_name)
    kind = gguf.GGMLQuantizationType[type_name]
    assert raw.dtype == np.uint8 and raw.shape == gguf.quants.quant_shape_to_byte_shape(w.shape, kind)
    back = gguf.quants.dequantize(raw, kind).reshape(w.shape)
    assert np.isfinite(back).all()
    span = np.maximum(w.max(1) - np.minimum(w.min(1), 0), 1e-6)[:, None]  # [8, 1]
    assert (np.abs(back - w) / span).max() <= tolerance
    assert np.array_equal(back[1], w[1]) and np.allclose(back[2, :256], 5.0, rtol=2e-3)


def test_encode_refuses_rows_blocks_do_not_fit():
    with pytest.raises(SpecdraftError, match="blocks"):
        encode(np.zeros((2, 96), np.float32), "Q4_K")


# ----- llama.cpp's mixes -----------------------------------------------------------------------
def test_q4_k_m_mix():
    """llama-quantize's Q4_K_M: Q6_K for attn_v (or Phi-3's attn_qkv) / ffn_down on `more_bits` layers
    (here layer 1 of 2) and the output; norms F32; a row no K-quant fits falls back to Q5_0."""
    types = preset_types(tiny_config("llama"), "Q4_K_M")
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == types["token_embd.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    phi3 = preset_types(tiny_config("phi3"), "Q4_K_M")
    assert (phi3["blk.0.attn_qkv.weight"], phi3["blk.1.attn_qkv.weight"]) == ("Q4_K", "Q6_K")
    odd = preset_types(tiny_config("gemma3", hidden_size=288, head_dim=72), "Q4_K_M")
    assert odd["blk.0.attn_q.weight"] == "Q5_0" and odd["token_embd.weight"] == "Q8_0"


# ----- tokenizer -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_file():
    path = random_gguf.default_tokenizer()
    if path is None:
        pytest.skip("the bundled Qwen2.5-Coder GGUF is not in the cache folder")
    return path


def test_tokenizer_cut_keeps_specials_and_whole_merges(tokenizer_file):
    source = read_header(tokenizer_file, "tokenizer.")
    fields = tokenizer_fields(tokenizer_file, 512)
    tokens = fields["tokenizer.ggml.tokens"].value
    assert len(tokens) == len(fields["tokenizer.ggml.token_type"].value) == 512
    eos = source.get("tokenizer.ggml.tokens")[source.get("tokenizer.ggml.eos_token_id")]
    assert tokens[fields["tokenizer.ggml.eos_token_id"].value] == eos  # moved inside the vocabulary, id rewritten
    kept = set(tokens)
    for merge in fields["tokenizer.ggml.merges"].value:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= kept
    count = len(source.get("tokenizer.ggml.tokens"))
    padded = tokenizer_fields(tokenizer_file, count + 3)
    assert padded["tokenizer.ggml.tokens"].value[-1] == f"[PAD{count + 2}]"
    assert padded["tokenizer.ggml.token_type"].value[-1] == gguf.TokenType.UNUSED


def test_tokenizer_loads_in_transformers(tokenizer_file, tmp_path):
    from transformers import AutoTokenizer

    write_random_gguf(tiny_config("qwen3"), tmp_path / "tok.gguf", "Q8_0", tokenizer=tokenizer_file)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    ids = tokenizer("def add(a, b):\n    return a + b<|im_end|>").input_ids
    eos = file_reference(tmp_path / "tok.gguf").config.eos_token_id
    assert len(tokenizer) == 512 and max(ids) < 512 and ids[-1] == eos


# ----- llama.cpp (optional: llama-cpp-python, and llama-quantize built from source) --------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_agrees_with_transformers(family, tokenizer_file, tmp_path):
    """llama.cpp loads every family's file, and its F32 logits are transformers' within its float16 KV cache."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_random_gguf(tiny_config(family), tmp_path / "m.gguf", "F32", tokenizer=tokenizer_file)
    with torch.no_grad():
        expected = file_reference(path)(PROMPT).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=1, logits_all=True, verbose=False, n_ctx=64)
    llm.eval(PROMPT[0].tolist())
    got = np.array(llm.scores[:PROMPT.shape[1]])
    assert np.abs(got - expected).max() < 0.1 and (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.fixture(scope="module")
def llama_quantize():
    """llama-quantize where it was built here (`python -m specdraft.bench.random_gguf` builds it once: about 12
    minutes on 2 cores); `make test` builds no part of llama.cpp, so a fresh machine skips the tests that need it."""
    from specdraft.bench.llama_cpp_build import BUILDS

    built = BUILDS["no-amx"].bin / "llama-quantize"
    if not built.is_file():
        pytest.skip("llama-quantize is not built here (python -m specdraft.bench.random_gguf builds it once)")
    return built


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_preset_types_are_llama_quantizes(family, llama_quantize, tmp_path):
    """`preset_types` picks what llama-quantize picks, for every preset and family."""
    config = tiny_config(family)
    source = write_random_gguf(config, tmp_path / "f16.gguf", "F16")
    for preset in random_gguf.LLAMA_QUANTIZE_PRESETS:
        out = random_gguf.llama_quantize(source, tmp_path / f"{preset}.gguf", preset)
        assert read_types(out) == preset_types(config, preset), preset


@pytest.mark.slow
def test_real_shape_streams(llama_quantize, tmp_path):
    """A real shape is written tensor by tensor and quantized by llama-quantize (here Gemma 3 1B, whose
    1152-wide rows need llama.cpp's fallbacks)."""
    out = random_gguf.make_real_shape("gemma-3-1b", "Q4_K_M", tmp_path / "gemma.gguf")
    assert read_types(out) == preset_types(random_gguf.shape_config("gemma-3-1b"), "Q4_K_M")


def test_real_shape_always_gets_a_tokenizer(tmp_path, monkeypatch):
    """Without `tokenizer`, a real shape takes the bundled draft's, assembled from its packages where the cache folder
    lacks it (a model written with none failed to load, and nothing said so while writing it)."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    asked = []

    def written(config, path, quant, tokenizer, seed):  # stands for the 2.5 GB F16 write
        asked.append(tokenizer)
        raise RuntimeError("written")

    monkeypatch.setattr(random_gguf, "write_random_gguf", written)
    with pytest.raises(RuntimeError, match="written"):
        random_gguf.make_real_shape("llama-3.2-1b", "Q4_K_M", tmp_path / "llama.gguf")
    assert asked == [tmp_path / "cache" / "qwen2.5-coder-0.5b-instruct.gguf"] and asked[0].is_file()
