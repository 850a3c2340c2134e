"""Random models of the families people run, as GGUF files written the way llama.cpp's
`convert_hf_to_gguf.py` writes them: tiny ones for tests, real shapes for speed work.

families   `llama`, `qwen2`, `qwen3`, `gemma2`, `gemma3` (text), `phi3`: a `Family` each, read by one
           writer (no per-family code paths beyond the converter's own rules). A Mistral model is
           written as llama, as the converter does (transformers reads it back as Llama: the same model
           without a sliding window)
values     `random_tensors(config, seed)`: the layers' matrices N(0, `STD`), the embedding and output
           N(0, `OUTPUT_STD`), every norm weight its identity value (1, or 0 in Gemma's `1 + w`) plus
           N(0, `NOISE_1D`), every bias N(0, `NOISE_1D`); each tensor from its own generator (seed, tensor
           name), so a model can be made tensor by tensor (real shapes never hold the float model) and
           `random_model` holds the same values. Gemma multiplies its input embedding by sqrt(hidden):
           its embedding is drawn sqrt(hidden) smaller and, when tied, the final norm carries the factor
           back, so inputs and logits have the other families' scale.
layout     tensor names from gguf-py's `get_tensor_name_map`; llama's q/k rows permuted (rotate-half to
           interleaved pairs, `LlamaModel.permute`); Gemma norms stored as `1 + w`; tied models write no
           `output.weight`; Llama 3's rope scaling as a `rope_freqs` tensor of frequency factors; 1-D
           tensors F32; metadata as the converter sets it (plus `vocab_size` for every family, and the
           sliding-window pattern for Gemma, which llama.cpp reads and the converter leaves to its default)
types      F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (gguf-py's encoders) and Q4_K, Q5_K, Q6_K (plain
           min/max encoders here: valid blocks, not llama.cpp's optimal ones); `preset_types` gives
           llama.cpp's Q4_K_M / Q5_K_M / Q8_0 / Q4_0 / F16 mixes
tokenizer  optional: another GGUF file's `tokenizer.*` fields, cut or padded to the model's vocabulary
real       `make_real_shape`: a published shape written F16 tensor by tensor, then `llama-quantize`
           (built once from llama.cpp's source into the cache folder) makes the real llama.cpp mix

Why these scales (transformers' own init is N(0, 0.02) everywhere): at 0.02 a 2-layer model's logits
spread about 0.3, so the top two tokens are a near-tie almost everywhere and greedy output hangs on
rounding. With the layers at 0.1 and the embedding / output at 0.3 the logits spread about 4.8, the
median top-1 / top-2 gap is about 1 logit and the mean top-1 probability about 0.55 (tiny models of
every family, tied or not), and under 3% of greedy tokens copy their input (about 25% for tied Gemma).

What transformers' GGUF loader (5.24, the legacy path of `modeling_gguf_pytorch_utils`) reads back
and what `file_reference` sets itself because the loader does not read it:
- weights: all of them, dequantized (gguf.dequantize) and un-permuted / `- 1`-shifted: exact.
- config: layers, sizes, heads, rope theta, rms eps, vocab size, sliding window, tied embeddings (from
  the absence of `output.weight`), bos / eos / pad ids when a tokenizer is written.
- not read, set by `file_reference`: `head_dim` (qwen3 has no key for it, and its default is 128);
  Gemma's `query_pre_attn_scalar` (llama.cpp scales by 1/sqrt(head_dim); transformers' default is
  256), `layer_types` (from the pattern) and the sliding layers' rope theta; Phi-3's
  `partial_rotary_factor` (from `rope.dimension_count`); Llama 3's rope scaling (recovered from
  `rope_freqs` and checked against it); token ids outside the vocabulary dropped.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, MODEL_ARCH

from specdraft.errors import SpecdraftError
from specdraft.models.architectures import head_dim_of
from specdraft.models.gguf_config import LLAMA3_ROPE, gguf_config, llama3_rope_factors
from specdraft.models.gguf_header import GgufField, read_header
from specdraft.paths import cache_dir

STD = 0.1  # the layers' matrices: N(0, STD) (see the module docstring)
OUTPUT_STD = 0.3  # the embedding and output matrices: N(0, OUTPUT_STD)
NOISE_1D = 0.1  # norm weights and biases: their identity value + N(0, NOISE_1D), so their layout is tested
QK_K = 256  # K-quant super-block
LLAMA_QUANTIZE_PRESETS = ("Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0")  # what make_real_shape asks llama-quantize for
PRESETS = (*LLAMA_QUANTIZE_PRESETS, "F16", "BF16", "F32")


# ----- families --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
    """How one model family is written: its GGUF architecture and the converter's rules for it."""

    name: str
    arch: MODEL_ARCH
    config_class: str  # the transformers config class
    permute_qk: bool = False  # llama: q/k rows from rotate-half halves to interleaved pairs
    norm_offset: float = 0.0  # Gemma: the stored norm weight is offset + w
    embed_scale: bool = False  # Gemma: input embeddings are multiplied by sqrt(hidden)
    tiny: Mapping = dataclasses.field(default_factory=dict)  # tiny_config's fields beyond TINY

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


FAMILIES = {family.name: family for family in (
    Family("llama", MODEL_ARCH.LLAMA, "LlamaConfig", permute_qk=True),
    Family("qwen2", MODEL_ARCH.QWEN2, "Qwen2Config"),
    Family("qwen3", MODEL_ARCH.QWEN3, "Qwen3Config"),
    # one sliding and one full layer (Gemma 2's own alternation), a window short prompts pass
    Family("gemma2", MODEL_ARCH.GEMMA2, "Gemma2Config", norm_offset=1.0, embed_scale=True,
           tiny={"sliding_window": 8, "query_pre_attn_scalar": 64}),
    Family("gemma3", MODEL_ARCH.GEMMA3, "Gemma3TextConfig", norm_offset=1.0, embed_scale=True,
           tiny={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                 "query_pre_attn_scalar": 64}),
    # Phi-3's default token ids (32000) lie outside a tiny vocabulary
    Family("phi3", MODEL_ARCH.PHI3, "Phi3Config", tiny={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
)}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "phi3": "phi3"}  # transformers model_type -> family

# K-quants need in_features % 256 == 0; head_dim is dropped for config classes without it (phi3, qwen2)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=512, max_position_embeddings=2048)

LLAMA_32_ROPE = {**LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 32.0}
# Published config.json fields (family, fields). Phi-4-mini's LongRoPE factors are left out (plain rope over its
# 96 rotary dims; a config with `longrope` parameters writes them): speed work does not depend on them.
REAL_SHAPES = {
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=LLAMA_32_ROPE, bos_token_id=128000, eos_token_id=128001)),
    "llama-3.2-3b": ("llama", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=LLAMA_32_ROPE, bos_token_id=128000, eos_token_id=128001)),
    "qwen3-1.7b": ("qwen3", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643, eos_token_id=151645)),
    "qwen3-4b": ("qwen3", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643, eos_token_id=151645)),
    "gemma-3-1b": ("gemma3", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "phi-4-mini": ("phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        vocab_size=200064, tie_word_embeddings=True, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        bos_token_id=199999, eos_token_id=199999, pad_token_id=199999)),
}


def family_of(config) -> Family:
    """The family of a transformers config (by its `model_type`)."""
    if config.model_type not in MODEL_TYPES:
        raise SpecdraftError(f"No GGUF family for model type {config.model_type!r}; known: {sorted(MODEL_TYPES)}.")
    return FAMILIES[MODEL_TYPES[config.model_type]]


def make_config(family: str, **fields):
    """The family's transformers config with these fields (`head_dim` dropped where the class has none)."""
    import transformers

    if family not in FAMILIES:
        raise SpecdraftError(f"Unknown family {family!r}; known: {sorted(FAMILIES)}.")
    config_class = getattr(transformers, FAMILIES[family].config_class)
    if not hasattr(config_class, "head_dim"):
        fields.pop("head_dim", None)
    return config_class(**fields)


def tiny_config(family: str, **overrides):
    """A tiny config of the family: hidden 256, intermediate 512, 2 layers, 4 heads, 2 kv heads,
    head_dim 64, vocabulary 512 (every matrix's in_features a multiple of 256, so K-quants fit)."""
    return make_config(family, **{**TINY, **FAMILIES[family].tiny, **overrides})


# ----- values ----------------------------------------------------------------------------------
def hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """The transformers model's tensors and shapes (`lm_head` left out when tied), from a meta model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")}


def tensor_seed(seed: int, name: str) -> int:
    """One generator seed per (seed, tensor name), stable across runs and machines."""
    return zlib.crc32(f"{seed}:{name}".encode())


def random_tensors(config, seed: int = 0, std: float = STD, output_std: float = OUTPUT_STD
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 values) of a random model, one tensor at a time (see the module docstring)."""
    family = family_of(config)
    embed_gain = math.sqrt(config.hidden_size) if family.embed_scale else 1.0
    for name, shape in hf_shapes(config).items():
        generator = torch.Generator().manual_seed(tensor_seed(seed, name))
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("embed_tokens.weight"):  # Gemma multiplies it by sqrt(hidden) on the way in
            yield name, values.mul_(output_std / embed_gain)
        elif name == "lm_head.weight":
            yield name, values.mul_(output_std)
        elif len(shape) > 1:
            yield name, values.mul_(std)
        else:  # a norm weight (identity 1, or 0 in Gemma's 1 + w) or a bias (0)
            identity = 0.0 if name.endswith(".bias") or family.norm_offset else 1.0
            if name == "model.norm.weight" and config.tie_word_embeddings:  # the tied output's sqrt(hidden)
                identity += embed_gain - 1
            yield name, values.mul_(NOISE_1D).add_(identity)


def random_model(config, seed: int = 0, std: float = STD, output_std: float = OUTPUT_STD):
    """The transformers model of `config` in float32 and eval mode, holding `random_tensors(config, seed, ...)`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = model.state_dict()
    with torch.no_grad():
        for name, values in random_tensors(config, seed, std, output_std):
            params[name].copy_(values)
    return model.eval()


# ----- the converter's layout ------------------------------------------------------------------
def llama_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order: per head, rotate-half halves to interleaved pairs
    (`LlamaModel.permute`): rows [a0 a1 a2 a3 | b0 b1 b2 b3] -> [a0 b0 a1 b1 a2 b2 a3 b3]... per head."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def rope_parameters(config, layer_type: str = "full_attention") -> dict:
    """The rope parameters of one layer type (Gemma 3 keeps one dict per type, the rest one dict)."""
    parameters = config.rope_parameters or {}
    return parameters.get(layer_type, parameters)



def converted(config, hf_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, values) in llama.cpp's layout, from (transformers name, values): the converter's
    extra tensors first, then each tensor renamed, permuted and offset. Works on meta tensors too."""
    family = family_of(config)
    rope = rope_parameters(config)
    if rope.get("rope_type") == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(head_dim_of(config), rope)
    if rope.get("rope_type") == "longrope":  # Phi-3.5 / Phi-4-mini: the factors as tensors
        for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                            ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
            yield gguf.TENSOR_NAMES[tensor] + ".weight", torch.tensor(rope[key], dtype=torch.float32)
    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    for hf_name, values in hf_tensors:
        stem, _, suffix = hf_name.rpartition(".")
        name = names.get_name(stem)
        if name is None:
            raise SpecdraftError(f"No GGUF name for {hf_name!r} in architecture {family.arch_name!r}.")
        if family.permute_qk and stem.endswith("q_proj"):
            values = llama_permute(values, config.num_attention_heads)
        elif family.permute_qk and stem.endswith("k_proj"):
            values = llama_permute(values, config.num_key_value_heads)
        if family.norm_offset and hf_name.endswith("norm.weight"):
            values = values + family.norm_offset
        yield f"{name}.{suffix}", values


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape `[rows, in_features]` (numpy order), without making any values."""
    meta = ((name, torch.empty(shape, device="meta")) for name, shape in hf_shapes(config).items())
    return {name: tuple(values.shape) for name, values in converted(config, meta)}


# ----- tensor types ----------------------------------------------------------------------------
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
              "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
              "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
              "Q4_K": LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K}
PRESET_BASE = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "F16": "F16", "BF16": "BF16",
               "F32": "F32"}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's, for rows not a multiple of 256


def block_size(type_name: str) -> int:
    return gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def preset_types(config, preset: str = "Q4_K_M") -> dict[str, str]:
    """GGUF tensor name -> type name, as `llama-quantize` picks them for `preset` (llama_tensor_get_type):
    Q4_K_M is Q4_K with attn_v (or a fused attn_qkv) and ffn_down in Q6_K on `more_bits` layers and
    the output (the embedding when tied) in Q6_K; Q5_K_M the same over Q5_K; Q4_0 has a Q6_K output;
    a row length no K-quant fits falls back as llama.cpp does. 1-D tensors are F32. `llama-quantize`
    makes the same choices (tested for every family)."""
    if preset not in PRESET_BASE:
        raise SpecdraftError(f"Unknown preset {preset!r}; known: {sorted(PRESET_BASE)}.")
    base = PRESET_BASE[preset]
    shapes = tensor_shapes(config)
    tied = "output.weight" not in shapes
    types = {}
    for name, shape in shapes.items():
        parts = name.split(".")  # blk.{layer}.{kind}.weight, or {kind}.weight
        chosen = "F32" if len(shape) == 1 else base
        if chosen != base or base in ("F16", "BF16", "F32"):
            types[name] = chosen
            continue
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            chosen = "Q8_0" if base == "Q8_0" or shape[-1] % block_size(base) else "Q6_K"
        elif preset in ("Q4_K_M", "Q5_K_M") and parts[-2] in ("attn_v", "attn_qkv", "ffn_down") and more_bits(
                int(parts[1]), config.num_hidden_layers):  # llama.cpp counts a fused attn_qkv as an attn_v
            chosen = "Q6_K"
        if shape[-1] % block_size(chosen):
            chosen = FALLBACK.get(chosen, chosen)
        types[name] = chosen if shape[-1] % block_size(chosen) == 0 else "F16"
    return types


def file_type(types: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]) -> LlamaFileType:
    """`general.file_type`: the type holding most of the 2-D parameters (Q4_K -> MOSTLY_Q4_K_M ...)."""
    counts: dict[str, int] = {}
    for name, shape in shapes.items():
        if len(shape) > 1:
            counts[types[name]] = counts.get(types[name], 0) + math.prod(shape)
    return FILE_TYPES[max(counts, key=counts.get)]


# ----- K-quant encoders (plain min/max: valid blocks that decode close to the input) ------------
def _f16_bytes(values: np.ndarray) -> np.ndarray:  # [...] -> [..., 2] uint8
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def _f16_at_least(values: np.ndarray) -> np.ndarray:
    """fp16 values no smaller than `values` (>= the smallest subnormal), so steps made from them never clip."""
    return np.maximum(values * (1 + 2.0 ** -10), 2.0 ** -24).astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins `[..., 8]` as Q4_K / Q5_K's twelve bytes `[..., 12]` (get_scale_min_k4, inverted)."""
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def _affine_k(w: np.ndarray, levels: int):
    """Q4_K / Q5_K's affine code of `w [rows, K]`: per 32-value sub-block x ≈ d·sc·q - dmin·mn with 6-bit
    sc, mn and q in [0, levels]. The min is rounded up and the step up, so no value falls outside the code."""
    rows, k = w.shape
    x = w.reshape(rows, k // QK_K, 8, 32).astype(np.float32)  # [rows, nb, 8, 32]
    low = np.minimum(x.min(-1), 0.0)  # [rows, nb, 8]: the mins are subtracted, so low <= 0
    dmin = _f16_at_least((-low).max(-1) / 63)  # [rows, nb]
    mn = np.clip(np.ceil(-low / dmin.astype(np.float32)[..., None]), 0, 63)  # [rows, nb, 8]
    offset = dmin.astype(np.float32)[..., None] * mn  # [rows, nb, 8]
    need = (x.max(-1) + offset) / levels  # [rows, nb, 8]: the step each sub-block needs
    d = _f16_at_least(need.max(-1) / 63)  # [rows, nb]
    sc = np.clip(np.ceil(need / d.astype(np.float32)[..., None]), 1, 63)  # [rows, nb, 8]
    step = (d.astype(np.float32)[..., None] * sc)[..., None]  # [rows, nb, 8, 1]
    q = np.clip(np.rint((x + offset[..., None]) / step), 0, levels).astype(np.uint8)  # [rows, nb, 8, 32]
    scales = _pack_k_scales(sc.astype(np.uint8), mn.astype(np.uint8))  # [rows, nb, 12]
    head = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales], -1)
    return head, q  # [rows, nb, 16], [rows, nb, 8, 32]


def encode_q4k(w: np.ndarray) -> np.ndarray:
    """`w [rows, K]` as Q4_K bytes `[rows, K / 256 · 144]`: d, dmin, 12 scale bytes, then sub-blocks
    2p (low nibbles) and 2p + 1 (high nibbles) in 32-byte runs."""
    head, q = _affine_k(w, 15)
    qs = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # [rows, nb, 4, 32]
    return np.concatenate([head, qs.reshape(*qs.shape[:2], 128)], -1).reshape(w.shape[0], -1)


def encode_q5k(w: np.ndarray) -> np.ndarray:
    """`w [rows, K]` as Q5_K bytes `[rows, K / 256 · 176]`: d, dmin, 12 scale bytes, 32 bytes whose bit s is
    sub-block s's fifth bit, then the low nibbles as in Q4_K."""
    head, q = _affine_k(w, 31)
    qs = (q[:, :, 0::2] & 0x0F) | ((q[:, :, 1::2] & 0x0F) << 4)  # [rows, nb, 4, 32]
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None], axis=2)  # [rows, nb, 32]
    return np.concatenate([head, qh, qs.reshape(*qs.shape[:2], 128)], -1).reshape(w.shape[0], -1)


def encode_q6k(w: np.ndarray) -> np.ndarray:
    """`w [rows, K]` as Q6_K bytes `[rows, K / 256 · 210]`: x ≈ d·sc·(q - 32) per 16 values, int8 sc.
    Layout per super-block: ql[128] (value h·128 + e low nibble at byte h·64 + e, value h·128 + 64 + e
    high nibble), qh[64] (value h·128 + 32k + e's top two bits at bits 2k of byte h·32 + e), sc[16], d."""
    rows, k = w.shape
    nb = k // QK_K
    x = w.reshape(rows, nb, 16, 16).astype(np.float32)  # [rows, nb, 16, 16]
    need = np.abs(x).max(-1) / 31  # [rows, nb, 16]
    d = _f16_at_least(need.max(-1) / 127)  # [rows, nb]
    sc = np.clip(np.ceil(need / d.astype(np.float32)[..., None]), 1, 127)  # [rows, nb, 16]
    step = (d.astype(np.float32)[..., None] * sc)[..., None]  # [rows, nb, 16, 1]
    q = (np.clip(np.rint(x / step), -32, 31) + 32).astype(np.uint8).reshape(rows, nb, QK_K)  # [rows, nb, 256]
    halves = q.reshape(rows, nb, 2, 2, 64)  # [.., h, low/high nibble, e]
    ql = (halves[:, :, :, 0] & 0x0F) | ((halves[:, :, :, 1] & 0x0F) << 4)  # [rows, nb, 2, 64]
    quarters = q.reshape(rows, nb, 2, 4, 32)  # [.., h, k, e]
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]  # [4, 1]: bits 2k
    qh = np.bitwise_or.reduce(((quarters >> 4) & 3) << shifts, axis=3)  # [rows, nb, 2, 32]
    scales = sc.astype(np.int8).view(np.uint8)  # [rows, nb, 16]
    return np.concatenate([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64), scales, _f16_bytes(d)], -1).reshape(
        rows, -1)


K_ENCODERS = {"Q4_K": encode_q4k, "Q5_K": encode_q5k, "Q6_K": encode_q6k}


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values in a GGML type: float32 / float16 arrays, or the raw bytes `[rows, row bytes]` of the rest."""
    if type_name not in TYPES:
        raise SpecdraftError(f"Unknown tensor type {type_name!r}; known: {list(TYPES)}.")
    if type_name == "F32":
        return values.astype(np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    if values.shape[-1] % block_size(type_name):
        raise SpecdraftError(f"Rows of {values.shape[-1]} values do not fit {type_name} blocks of {block_size(type_name)}.")
    if type_name in K_ENCODERS:
        return K_ENCODERS[type_name](values)
    return gguf.quants.quantize(values, GGMLQuantizationType[type_name])


# ----- tokenizer -------------------------------------------------------------------------------
def tokenizer_fields(source: str | os.PathLike, vocab_size: int) -> dict[str, GgufField]:
    """`tokenizer.*` key -> value with its GGUF types, of another GGUF file, for `vocab_size` tokens.

    Padded as the converter pads: `[PAD{i}]` tokens of type UNUSED (score -1000). Cut: the first
    tokens are kept, but the special tokens (every `*_token_id`) past the cut take the last places,
    their ids rewritten; a merge stays only when both parts and their join stay.
    """
    fields = {key: (field.value, field.kind, field.item_kind)
              for key, field in read_header(source, "tokenizer.").fields.items() if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in fields:
        raise SpecdraftError(f"{source} has no tokenizer (no tokenizer.ggml.tokens).")
    tokens = fields["tokenizer.ggml.tokens"][0]
    id_keys = [key for key in fields if key.endswith("_token_id")]
    special = {int(fields[key][0]) for key in id_keys}
    order = list(range(min(vocab_size, len(tokens))))  # new id -> old id
    moved = sorted(special - set(order))
    ordinary = [i for i in order if i not in special]
    free = ordinary[len(ordinary) - len(moved):]  # the last ordinary places take the special tokens past the cut
    for new_id, old_id in zip(free, moved):
        order[new_id] = old_id
    new_of_old = {old: new for new, old in enumerate(order)}
    kept = {tokens[i] for i in order}
    pad = vocab_size - len(order)
    out = {}
    for key, (value, kind, item_kind) in fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            filler = {"tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
                      "tokenizer.ggml.scores": [-1000.0] * pad,
                      "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(order), vocab_size)]}[key]
            value = [value[i] for i in order] + filler
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if (parts := m.split(" ", 1)) and len(parts) == 2
                     and parts[0] in kept and parts[1] in kept and parts[0] + parts[1] in kept]
        elif key in id_keys:
            if int(value) not in new_of_old:
                continue
            value = new_of_old[int(value)]
        out[key] = GgufField(value, kind, item_kind)
    return out


# ----- metadata --------------------------------------------------------------------------------
def sliding_pattern(config) -> int | list[bool] | None:
    """llama.cpp's sliding-window pattern of `config.layer_types`: None without sliding layers, else the
    period P (layer i slides iff i % P < P - 1; 0: all slide), or one bool per layer where none fits."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [kind == "sliding_attention" for kind in layer_types]
    if not any(sliding) or not getattr(config, "sliding_window", None):
        return None
    for period in range(len(sliding) + 1):
        if all(s == (period == 0 or i % period < period - 1) for i, s in enumerate(sliding)):
            return period
    return sliding


def add_metadata(writer: GGUFWriter, config, ftype: LlamaFileType) -> None:
    """The keys `convert_hf_to_gguf.py` writes for the family (TextModel.set_gguf_parameters and the
    family's own), plus `vocab_size` (read by transformers; llama.cpp's size when there is no tokenizer)."""
    family = family_of(config)
    rope = rope_parameters(config)
    # not the model type: "phi3" in the name makes llama.cpp look for Phi-3's sentencepiece tokens
    writer.add_name("specdraft random model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if (local := rope_parameters(config, "sliding_attention")) is not rope and "rope_theta" in local:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "longrope":  # the factors are tensors; the converter's attention factor
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings)) if scale > 1 else 1.0)
    elif rope_type not in ("default", "llama3"):  # llama3 is the rope_freqs tensor
        raise SpecdraftError(f"Rope type {rope_type!r} is not written here (default, linear, llama3, longrope are).")
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if family.name == "llama":
        writer.add_rope_dimension_count(head_dim_of(config))
    if family.name == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
                                        // config.num_attention_heads)
        writer.add_sliding_window(config.sliding_window or 0)
    if family.name in ("gemma2", "gemma3"):
        if getattr(config, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if (pattern := sliding_pattern(config)) is not None:
            writer.add_sliding_window(config.sliding_window)
            writer.add_sliding_window_pattern(pattern)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ----- writing ---------------------------------------------------------------------------------
def write_tensors(config, hf_tensors: Iterable[tuple[str, torch.Tensor]], path: str | os.PathLike,
                  tensor_types: str | Mapping[str, str], tokenizer: str | os.PathLike | None = None) -> Path:
    """Write (transformers name, values) of a `config` model to `path`, one tensor at a time, in
    `hf_shapes(config)` order. `tensor_types`: a preset name or GGUF name -> type (every 2-D tensor;
    1-D tensors are always F32). `tokenizer`: a GGUF file whose tokenizer to copy (else none is written:
    llama.cpp's `none` vocabulary of `vocab_size` ids)."""
    path = Path(path)
    shapes = tensor_shapes(config)
    types = preset_types(config, tensor_types) if isinstance(tensor_types, str) else dict(tensor_types)
    types.update({name: "F32" for name, shape in shapes.items() if len(shape) == 1})
    missing = [name for name in shapes if name not in types]
    if missing:
        raise SpecdraftError(f"No tensor type for {missing[:5]}{'...' if len(missing) > 5 else ''}.")

    writer = GGUFWriter(str(path), family_of(config).arch_name)
    try:
        _write(writer, config, hf_tensors, shapes, types, tokenizer)
    finally:
        writer.close()
    return path


def _write(writer: GGUFWriter, config, hf_tensors, shapes: Mapping[str, tuple[int, ...]], types: Mapping[str, str],
           tokenizer) -> None:
    """`write_tensors`' steps: metadata and tokenizer, every tensor's info, then the values one by one."""
    add_metadata(writer, config, file_type(types, shapes))
    if tokenizer is None:
        writer.add_tokenizer_model("none")
    else:
        for key, field in tokenizer_fields(tokenizer, config.vocab_size).items():
            writer.add_key_value(key, field.value, field.kind, sub_type=field.item_kind)
    for name, shape in shapes.items():
        kind = GGMLQuantizationType[types[name]]
        if types[name] in ("F32", "F16"):
            writer.add_tensor_info(name, shape, np.dtype(np.float32 if types[name] == "F32" else np.float16),
                                   math.prod(shape) * (4 if types[name] == "F32" else 2))
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    planned = iter(shapes.items())
    for name, values in converted(config, hf_tensors):
        expected, shape = next(planned)
        if (name, tuple(values.shape)) != (expected, shape):
            raise SpecdraftError(f"Tensor {name} {tuple(values.shape)} came where {expected} {shape} was planned.")
        writer.write_tensor_data(encode(values.detach().float().numpy(), types[name]))


def write_gguf(model, path: str | os.PathLike, tensor_types: str | Mapping[str, str] = "Q4_K_M",
               tokenizer: str | os.PathLike | None = None) -> Path:
    """Write a transformers model of a known family to `path` as `convert_hf_to_gguf.py` (then
    llama-quantize) would: `tensor_types` a preset name (`preset_types`) or GGUF name -> type name."""
    state = model.state_dict()
    names = hf_shapes(model.config)
    return write_tensors(model.config, ((name, state[name]) for name in names), path, tensor_types, tokenizer)


def write_random_gguf(config, path: str | os.PathLike, tensor_types: str | Mapping[str, str] = "F16",
                      tokenizer: str | os.PathLike | None = None, seed: int = 0, std: float = STD,
                      output_std: float = OUTPUT_STD) -> Path:
    """`write_gguf(random_model(config, seed, ...), ...)` without making the model: tensor by tensor."""
    return write_tensors(config, random_tensors(config, seed, std, output_std), path, tensor_types, tokenizer)


# ----- transformers' reading -------------------------------------------------------------------
def file_reference(path: str | os.PathLike):
    """The float32 transformers model of the file's own (dequantized) values, through transformers'
    GGUF loader (`from_pretrained(folder, gguf_file=name, config=..., dtype=float32)`), with the config
    completed as the loader completes it (`models.gguf_config`). Loads every family here, tokenizer or not."""
    from transformers import AutoModelForCausalLM

    path = Path(path).resolve()
    config = gguf_config(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    return model.eval()


# ----- llama-quantize and the real shapes -------------------------------------------------------
def build_llama_quantize(jobs: int = 2) -> Path:
    """`llama-quantize`, built once from llama.cpp's pinned source (`bench.llama_cpp_build`): the `no-amx` build
    (native CPU flags with AMX off: quantizing needs none, and a native AMX build can crash). Later calls return
    at once."""
    from specdraft.bench.llama_cpp_build import BUILDS, build_tools

    return build_tools(["llama-quantize"], BUILDS["no-amx"], jobs) / "llama-quantize"


def llama_quantize(source: str | os.PathLike, out: str | os.PathLike, quant: str, threads: int = 2) -> Path:
    """`llama-quantize source out quant threads`: llama.cpp's own mix of `quant` (Q4_K_M, Q5_K_M, Q8_0, Q4_0)."""
    if quant not in LLAMA_QUANTIZE_PRESETS:
        raise SpecdraftError(f"llama-quantize presets here: {LLAMA_QUANTIZE_PRESETS}, not {quant!r}.")
    run = subprocess.run([str(build_llama_quantize()), str(source), str(out), quant, str(threads)],
                         capture_output=True, text=True)
    if run.returncode:
        raise SpecdraftError(f"llama-quantize failed ({run.returncode}): {run.stderr[-2000:]}")
    return Path(out)


def default_tokenizer() -> Path | None:
    """The bundled Qwen2.5-Coder-0.5B GGUF (151,936 tokens), if it is in the cache folder."""
    path = cache_dir() / "qwen2.5-coder-0.5b-instruct.gguf"
    return path if path.is_file() else None


def bundled_tokenizer() -> Path:
    """The bundled Qwen2.5-Coder-0.5B GGUF, assembled from its packages into the cache folder where it is not there
    yet (a clear error names the pip command where they are not installed)."""
    from specdraft.models.registry import DEFAULT_DRAFT, assemble, get_bundled

    return default_tokenizer() or assemble(get_bundled(DEFAULT_DRAFT))


def shape_config(shape: str):
    """The config of a `REAL_SHAPES` name, or of `tiny-<family>`."""
    if shape.startswith("tiny-") and shape[5:] in FAMILIES:
        return tiny_config(shape[5:])
    if shape not in REAL_SHAPES:
        raise SpecdraftError(f"Unknown shape {shape!r}; known: {sorted(REAL_SHAPES)} and tiny-<family>.")
    family, fields = REAL_SHAPES[shape]
    return make_config(family, **copy.deepcopy(fields))  # config classes may complete their rope dicts in place


def make_real_shape(shape: str, quant: str, out: str | os.PathLike, seed: int = 0,
                    tokenizer: str | os.PathLike | None = None) -> Path:
    """A random model of a published shape at `out`: written F16 tensor by tensor (with `tokenizer`,
    default the bundled one, assembled from its packages if need be), then `llama-quantize`d to `quant`
    (F16 / BF16 / F32: written as is).
    `tiny-<family>` shapes are written with `preset_types` directly, no llama-quantize.

    On 2 cores (Q4_K_M): Llama-3.2-1B 19 s to write + 91 s to quantize, Qwen3-4B 56 + 237 s; peak
    memory 2-4 GiB (the largest tensor, not the model)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape)
    if tokenizer is None:  # a model the loader can read: it needs a tokenizer
        tokenizer = default_tokenizer() if shape.startswith("tiny-") else bundled_tokenizer()
    if shape.startswith("tiny-") or quant in ("F16", "BF16", "F32"):
        return write_random_gguf(config, out, quant, tokenizer, seed)
    float_file = out.with_name(out.name + ".f16.partial")
    try:
        write_random_gguf(config, float_file, "F16", tokenizer, seed)
        return llama_quantize(float_file, out, quant)
    finally:
        float_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdraft.bench.random_gguf", description=make_real_shape.__doc__)
    parser.add_argument("--shape", required=True, help=f"{', '.join(REAL_SHAPES)}, or tiny-<family> ({', '.join(FAMILIES)})")
    parser.add_argument("--quant", default="Q4_K_M", choices=PRESETS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="a GGUF file whose tokenizer to copy (default: the bundled one)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = make_real_shape(args.shape, args.quant, args.out, args.seed, args.tokenizer)
    except SpecdraftError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
