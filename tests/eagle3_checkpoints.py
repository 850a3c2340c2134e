"""Random-weight EAGLE-3 heads in the published formats, for the tests: the config.json keys and tensor names of a
SpecForge checkpoint (`LlamaForCausalLMEagle3`, `midlayer.*`), a vLLM speculators one (`Eagle3Speculator`, the
layer's config nested as `transformer_layer_config`, `layers.0.*`), and the GGUF llama.cpp's
`convert_hf_to_gguf.py --target-model-dir` makes of them (read from the converter in llama-cpp-python 0.3.36:
`conversion/llama.py`, the eagle3 branches; gguf-py's EAGLE3 tensor table; `src/models/eagle3.cpp`).

Weights are drawn from an explicit generator and rounded to float16, so the GGUF (F16 matrices, F32 norms, as the
converter writes by default) holds the same values as the folders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


@dataclass
class Head:
    """A head as published: its config.json, its tensors by published name, and what it was made for."""

    config: dict
    tensors: dict[str, torch.Tensor]
    fmt: str  # "specforge" or "speculators"
    aux_layers: tuple[int, ...]  # transformers' hidden_states indices it reads
    target_ids: list[int] = field(default_factory=list)  # draft id j -> target id


def _normal(generator: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std).half().float()


def _norm(generator: torch.Generator, size: int) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(size, generator=generator)).half().float()


def random_head(target_config, fmt: str, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                intermediate: int, draft_ids: list[int], aux_layers: tuple[int, ...] | None = None,
                layer_type: str = "llama", rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                norm_before_residual: bool = False, norm_before_fc: bool = False, fc_norm: bool = False,
                norm_output: bool | None = None, own_embeddings: bool = True, head_scale: float = 4.0,
                seed: int = 0) -> Head:
    """A random head for a target of `target_config` (a transformers config) in format `fmt`, its draft vocabulary
    `draft_ids` (target ids, in draft-id order), reading `aux_layers` (None: write none, the sources' default)."""
    g = torch.Generator().manual_seed(seed)
    target_hidden, vocab = target_config.hidden_size, target_config.vocab_size
    fused = 3 * target_hidden
    prefix = "midlayer." if fmt == "specforge" else "layers.0."
    t = {
        "fc.weight": _normal(g, hidden, fused, std=fused ** -0.5),
        prefix + "input_layernorm.weight": _norm(g, hidden),
        prefix + "hidden_norm.weight": _norm(g, hidden),
        prefix + "self_attn.q_proj.weight": _normal(g, heads * head_dim, 2 * hidden, std=(2 * hidden) ** -0.5),
        prefix + "self_attn.k_proj.weight": _normal(g, kv_heads * head_dim, 2 * hidden, std=(2 * hidden) ** -0.5),
        prefix + "self_attn.v_proj.weight": _normal(g, kv_heads * head_dim, 2 * hidden, std=(2 * hidden) ** -0.5),
        prefix + "self_attn.o_proj.weight": _normal(g, hidden, heads * head_dim, std=(heads * head_dim) ** -0.5),
        prefix + "post_attention_layernorm.weight": _norm(g, hidden),
        prefix + "mlp.gate_proj.weight": _normal(g, intermediate, hidden, std=hidden ** -0.5),
        prefix + "mlp.up_proj.weight": _normal(g, intermediate, hidden, std=hidden ** -0.5),
        prefix + "mlp.down_proj.weight": _normal(g, hidden, intermediate, std=intermediate ** -0.5),
        "norm.weight": _norm(g, hidden),
        "lm_head.weight": _normal(g, len(draft_ids), hidden, std=head_scale * hidden ** -0.5),
    }
    if layer_type == "qwen3":
        t[prefix + "self_attn.q_norm.weight"] = _norm(g, head_dim)
        t[prefix + "self_attn.k_norm.weight"] = _norm(g, head_dim)
    if own_embeddings:
        t["embed_tokens.weight"] = _normal(g, vocab, hidden, std=1.0)
    if norm_before_fc:
        t["input_norm.weight"] = _norm(g, fused)
    if fc_norm:
        for i in range(3):
            t[f"fc_norm.{i}.weight"] = _norm(g, target_hidden)
    ids = torch.tensor(draft_ids)
    if len(draft_ids) != vocab:
        t["d2t"] = ids - torch.arange(len(draft_ids))  # draft id j -> target id j + d2t[j]
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    layer = {"hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
             "rms_norm_eps": 1e-5 if layer_type == "llama" else 1e-6, "rope_theta": rope_theta,
             "rope_scaling": rope_scaling, "max_position_embeddings": 131072, "vocab_size": vocab,
             "tie_word_embeddings": False}
    if fmt == "specforge":
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer,
                  "draft_vocab_size": len(draft_ids), "torch_dtype": "float16"}
        if target_hidden != hidden:
            config["target_hidden_size"] = target_hidden
        if aux_layers is not None:  # SGLang's convention: layer i's output, transformers' hidden_states[i + 1]
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layers],
                                      "use_aux_hidden_state": True}
        if fc_norm:
            config["fc_norm"] = True
        if norm_output is not None:
            config["norm_output"] = norm_output
        if norm_before_residual:
            config["norm_before_residual"] = True
        if norm_before_fc:
            config["norm_before_fc"] = True
    else:
        from transformers import LlamaConfig, Qwen3Config

        layer_class = Qwen3Config if layer_type == "qwen3" else LlamaConfig
        nested = layer_class(**{k: v for k, v in layer.items() if v is not None}).to_diff_dict()  # as speculators saves
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.3.0", "transformer_layer_config": nested,
                  "draft_vocab_size": len(draft_ids), "norm_before_residual": norm_before_residual,
                  "norm_before_fc": norm_before_fc, "fc_norm": fc_norm, "norm_output": bool(norm_output),
                  "target_hidden_size": target_hidden if target_hidden != hidden else None,
                  "eagle_aux_hidden_state_layer_ids": list(aux_layers) if aux_layers is not None else None,
                  "embed_requires_grad": False,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                         "verifier": {"name_or_path": "tiny-target", "architectures": ["X"]}}}
    layers = target_config.num_hidden_layers
    resolved = aux_layers or (2, layers // 2, layers - 3)
    return Head(config, t, fmt, tuple(resolved), list(draft_ids))


def save_folder(head: Head, folder: Path) -> Path:
    """The head as a checkpoint folder: config.json and model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.config, indent=2))
    save_file({name: value.contiguous() for name, value in head.tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows into llama.cpp's rotary order, as the converter's `LlamaModel.permute` (k with its kv heads)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def save_gguf(head: Head, path: Path, target_config) -> Path:
    """The GGUF `convert_hf_to_gguf.py --target-model-dir` writes of `head` (a SpecForge-format, Llama-layer head):
    architecture eagle3, its metadata keys, tensor names, q/k permutation and `d2t` as absolute I64 target ids. The
    target's tokenizer metadata is left out (the drafter reads the target's own)."""
    from gguf import GGUFWriter

    from specdraft.models.gguf_config import llama3_rope_factors

    c, t = head.config, head.tensors
    layer = c.get("transformer_layer_config", c)
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    writer = GGUFWriter(str(path), "eagle3")
    writer.add_block_count(1)
    writer.add_context_length(layer["max_position_embeddings"])
    writer.add_embedding_length(layer["hidden_size"])
    writer.add_feed_forward_length(layer["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(layer["rope_theta"])
    writer.add_layer_norm_rms_eps(layer["rms_norm_eps"])
    writer.add_key_length(layer["head_dim"])
    writer.add_value_length(layer["head_dim"])
    writer.add_file_type(1)  # MOSTLY_F16
    writer.add_vocab_size(layer["vocab_size"])
    writer.add_rope_dimension_count(layer["head_dim"])
    layers = target_config.num_hidden_layers  # the converter: the top-level ids, else the default (not eagle_config's)
    writer.add_array("eagle3.target_layers", c.get("eagle_aux_hidden_state_layer_ids") or [2, layers // 2, layers - 3])
    writer.add_uint32("eagle3.target_hidden_size", c.get("target_hidden_size") or target_config.hidden_size)
    writer.add_bool("eagle3.norm_before_residual", bool(c.get("norm_before_residual", False)))
    writer.add_bool("eagle3.norm_before_fc", bool(c.get("norm_before_fc", False)))
    names = {"fc.weight": "fc.weight", "input_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight", "embed_tokens.weight": "token_embd.weight",
             "input_layernorm.weight": "blk.0.attn_norm.weight", "hidden_norm.weight": "blk.0.attn_norm_2.weight",
             "self_attn.q_proj.weight": "blk.0.attn_q.weight", "self_attn.k_proj.weight": "blk.0.attn_k.weight",
             "self_attn.v_proj.weight": "blk.0.attn_v.weight", "self_attn.o_proj.weight": "blk.0.attn_output.weight",
             "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
             "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
             "mlp.up_proj.weight": "blk.0.ffn_up.weight", "mlp.down_proj.weight": "blk.0.ffn_down.weight"}
    for name, value in t.items():
        if name in ("d2t", "t2d"):
            continue
        short = name.removeprefix("midlayer.").removeprefix("layers.0.")
        if short == "self_attn.q_proj.weight":
            value = _permute(value, heads)
        elif short == "self_attn.k_proj.weight":
            value = _permute(value, kv_heads)
        array = value.numpy().astype(np.float32 if value.dim() == 1 else np.float16)
        writer.add_tensor(names[short], array)
    if c.get("rope_scaling") and c["rope_scaling"].get("rope_type") == "llama3":
        rope = {**c["rope_scaling"], "rope_theta": layer["rope_theta"]}
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(layer["head_dim"], rope).numpy())
    if "d2t" in t:
        absolute = (t["d2t"] + torch.arange(t["d2t"].shape[0])).numpy().astype(np.int64)
        writer.add_tensor("d2t", absolute)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def draft_vocabulary(vocab: int, keep: int, seed: int, shuffled: bool = False) -> list[int]:
    """`keep` target ids of `vocab` for a draft vocabulary: sorted (as SpecForge maps them), or in a shuffled
    draft-id order (which d2t allows)."""
    g = torch.Generator().manual_seed(seed)
    ids = sorted(torch.randperm(vocab, generator=g)[:keep].tolist())
    if shuffled:
        ids = [ids[i] for i in torch.randperm(keep, generator=g).tolist()]
    return ids
