"""Random-weight MTP layers in the layout a DeepSeek-V3 / GLM-4.5 checkpoint carries them (`models.mtp_loading`),
for a tiny Llama, Qwen2 or Qwen3 target: config.json with `num_nextn_predict_layers`, and the layer's tensors
`model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,...}` beside the target's own in its safetensors (names from
vLLM's `deepseek_mtp.py` and llama.cpp's nextn tensor map, gguf-py `tensor_mapping.py`).

Weights are drawn from an explicit generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _normal(generator: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * std


def _norm(generator: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(size, generator=generator)


def random_mtp_layer(config, *, own_embeddings: bool = False, own_head: bool = False, head_scale: float = 20.0,
                     extra_layers: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a random MTP layer for a target of transformers `config` (Llama: biases where
    `attention_bias`; Qwen2: q/k/v biases; Qwen3: q/k norms), published names, at model.layers.{L} (and
    `extra_layers` more after it, which the loader must ignore)."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or hidden // heads
    kind = config.model_type
    tensors: dict[str, torch.Tensor] = {}
    for index in range(config.num_hidden_layers, config.num_hidden_layers + 1 + extra_layers):
        p = f"model.layers.{index}."
        t = {
            "enorm.weight": _norm(g, hidden), "hnorm.weight": _norm(g, hidden),
            "eh_proj.weight": _normal(g, hidden, 2 * hidden, std=(2 * hidden) ** -0.5),
            "shared_head.norm.weight": _norm(g, hidden),
            "input_layernorm.weight": _norm(g, hidden),
            "self_attn.q_proj.weight": _normal(g, heads * d, hidden, std=hidden ** -0.5),
            "self_attn.k_proj.weight": _normal(g, kv * d, hidden, std=hidden ** -0.5),
            "self_attn.v_proj.weight": _normal(g, kv * d, hidden, std=hidden ** -0.5),
            "self_attn.o_proj.weight": _normal(g, hidden, heads * d, std=(heads * d) ** -0.5),
            "post_attention_layernorm.weight": _norm(g, hidden),
            "mlp.gate_proj.weight": _normal(g, inter, hidden, std=hidden ** -0.5),
            "mlp.up_proj.weight": _normal(g, inter, hidden, std=hidden ** -0.5),
            "mlp.down_proj.weight": _normal(g, hidden, inter, std=inter ** -0.5),
        }
        if kind == "qwen2" or getattr(config, "attention_bias", False):
            for name in ("q", "k", "v"):
                rows = t[f"self_attn.{name}_proj.weight"].shape[0]
                t[f"self_attn.{name}_proj.bias"] = _normal(g, rows, std=0.1)
            if getattr(config, "attention_bias", False):
                t["self_attn.o_proj.bias"] = _normal(g, hidden, std=0.1)
        if kind == "qwen3":
            t["self_attn.q_norm.weight"] = _norm(g, d)
            t["self_attn.k_norm.weight"] = _norm(g, d)
        if own_embeddings:
            t["embed_tokens.weight"] = _normal(g, vocab, hidden, std=1.0)
        if own_head:
            t["shared_head.head.weight"] = _normal(g, vocab, hidden, std=head_scale * hidden ** -0.5)
        tensors.update({p + name: value for name, value in t.items()})
    return tensors


def save_with_mtp(target_model, mtp: dict[str, torch.Tensor], folder: Path, layers: int = 1,
                  shards: bool = False) -> Path:
    """`target_model` saved by transformers, then its weights rewritten with the MTP tensors beside them and
    `num_nextn_predict_layers` in config.json, as the published checkpoints keep them (`shards`: the MTP layer
    in a shard of its own, named by model.safetensors.index.json)."""
    target_model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    own = {name: value.detach().contiguous() for name, value in target_model.state_dict().items()}
    if shards:
        (folder / "model.safetensors").unlink()
        save_file(own, str(folder / "model-00001-of-00002.safetensors"))
        save_file({k: v.contiguous() for k, v in mtp.items()}, str(folder / "model-00002-of-00002.safetensors"))
        weight_map = {**{name: "model-00001-of-00002.safetensors" for name in own},
                      **{name: "model-00002-of-00002.safetensors" for name in mtp}}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file({**own, **{k: v.contiguous() for k, v in mtp.items()}}, str(folder / "model.safetensors"))
    return folder
