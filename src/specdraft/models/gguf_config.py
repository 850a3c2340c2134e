"""A GGUF file's transformers config, completed with what llama.cpp reads from the file and transformers' GGUF
config parser (5.x) leaves at its defaults:

- `head_dim` from `{arch}.attention.key_length` (Qwen3's parser has no key for it; its default is 128);
- Gemma 2 / 3: `query_pre_attn_scalar` (llama.cpp scales queries by 1/sqrt(head_dim), or by
  1/sqrt(hidden / heads) for the 27B shape), which layers slide (`sliding_window_pattern`) and Gemma 3's
  sliding layers' rotary base (`rope.freq_base_swa`), the logit soft-caps;
- Phi-3: the rotary's share of each head (`rope.dimension_count`: Phi-4-mini turns 96 of 128 dimensions), and
  Phi-3.5 / Phi-4-mini's LongRoPE factors (tensors in the file) as transformers' `longrope` parameters;
- Llama 3.1+: the rotary scaling, which the file holds only as a `rope_freqs` tensor of frequency factors,
  recovered as transformers' `llama3` rope parameters when the factors are that scaling's (else left to the
  packed loader, which divides the frequencies by the factors itself);
- token ids outside the vocabulary dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from specdraft.models.architectures import ARCHITECTURES, LONGROPE_FACTORS, head_dim_of
from specdraft.models.gguf_header import GgufHeader, TensorEntry, read_header

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # Llama 3.1 / 3.2 / 3.3's published scaling


def llama3_rope_factors(head_dim: int, rope: Mapping) -> torch.Tensor:
    """Llama 3's rope scaling as frequency factors `[head_dim / 2]`, as llama.cpp's converter computes `rope_freqs`."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def transformers_config_dict(header: GgufHeader) -> dict:
    """The config dict transformers' GGUF parser (`load_gguf_checkpoint`) makes of this header, from the same
    key table and defaults, without its minutes-long metadata parse."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = header.architecture
    renamed = "mistral" if "llama" in arch and header.get("general.name") == "mistral" else arch
    names = {entry.name for entry in header.tensors}
    config = {"tie_word_embeddings": "output.weight" not in names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, field in header.fields.items():
        prefix, _, config_key = key.replace(arch, renamed).partition(".")
        value = field.value
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # as transformers reads a one-element array
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, renamed)
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key)
        if target is not None and target != -1:
            config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # a GGUF holds Gemma 3's text backbone only
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.fields:
        tokens = header.get("tokenizer.ggml.tokens")
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config


def _f32_vector(path: Path, entry: TensorEntry) -> np.ndarray:
    """A one-dimensional F32 tensor of the file (rotary factors), read where the header says it lies."""
    return np.fromfile(path, dtype=np.float32, count=entry.shape[-1], offset=entry.offset)


def complete_config(config, header: GgufHeader, path: Path):
    """`config` (transformers' parse of the GGUF file at `path`, whose header is `header`) completed as the
    module's text says; returns it."""
    arch = header.architecture
    if (key_length := header.get(f"{arch}.attention.key_length")) is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length)
    head_dim = head_dim_of(config)
    if arch in ("gemma2", "gemma3"):
        big = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp's 27B rule
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else head_dim
        window = header.get(f"{arch}.attention.sliding_window")
        pattern = header.get(f"{arch}.attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6}[arch])
        n = config.num_hidden_layers
        sliding = ([bool(s) for s in pattern] if isinstance(pattern, list)
                   else [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]) if window else [False] * n
        config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
        if arch == "gemma3" and (local := header.get("gemma3.rope.freq_base_swa")) is not None:
            config.rope_parameters["sliding_attention"]["rope_theta"] = float(local)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            setattr(config, key, header.get(f"{arch}.{key}"))
    if arch == "phi3" and (dims := header.get("phi3.rope.dimension_count")) is not None:
        config.rope_parameters["partial_rotary_factor"] = dims / head_dim
    if arch == "phi3":
        _read_longrope(config, header, path)
    factors = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if arch == "llama" and factors is not None and factors.type_name == "F32":
        factors = torch.from_numpy(_f32_vector(path, factors))
        rope = {**LLAMA3_ROPE, "rope_theta": config.rope_parameters["rope_theta"], "factor": float(factors.max())}
        if torch.allclose(llama3_rope_factors(head_dim, rope), factors):
            config.rope_parameters = rope
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= config.vocab_size:
            setattr(config, key, None)
    return config


def _read_longrope(config, header: GgufHeader, path: Path) -> None:
    """Phi-3.5 / Phi-4-mini's LongRoPE: the file's `rope_factors_long` / `_short` tensors and attention factor as
    transformers' `longrope` parameters, `factor` the file's context over its pretraining length. The config holds the
    pretraining length; a longer context, and with it the long factors for every pass, is chosen at load
    (`models.context.hold_context`)."""
    factors = {entry.name.split(".")[0]: entry for entry in header.tensors if entry.name.split(".")[0] in LONGROPE_FACTORS}
    original = header.get("phi3.rope.scaling.original_context_length")
    if set(factors) != set(LONGROPE_FACTORS) or original is None or any(e.type_name != "F32" for e in factors.values()):
        return  # not LongRoPE, or not as llama.cpp writes it: the loaders refuse the file (`longrope_refusal`)
    rope = {**config.rope_parameters, "rope_type": "longrope",
            "long_factor": _f32_vector(path, factors["rope_factors_long"]).tolist(),
            "short_factor": _f32_vector(path, factors["rope_factors_short"]).tolist(),
            "original_max_position_embeddings": int(original), "factor": config.max_position_embeddings / original}
    if (attention := header.get("phi3.rope.scaling.attn_factor")) is not None:
        rope["attention_factor"] = float(attention)
    config.rope_parameters = rope
    config.original_max_position_embeddings = config.max_position_embeddings = int(original)


def gguf_config(path: Path):
    """The transformers config of the GGUF file at `path`, completed (`complete_config`). The families the packed
    path declares are parsed from our header reader with transformers' key table; others by transformers."""
    from transformers import AutoConfig

    path = Path(path).resolve()
    header = read_header(path)
    if any(arch.name == header.architecture for arch in ARCHITECTURES):
        config = AutoConfig.for_model(**transformers_config_dict(header))
    else:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    return complete_config(config, header, path)
