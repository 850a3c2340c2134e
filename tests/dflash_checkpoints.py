"""Random-weight DFlash drafts in the published format (z-lab's `DFlashDraftModel`, `dflash/model.py`; the keys
llama.cpp's converter reads, `conversion/qwen.py` `DFlashModel`): a Qwen3 config.json with `block_size`,
`num_target_layers` and `dflash_config` (`target_layer_ids`, `mask_token_id`), and tensors `fc.weight`,
`hidden_norm.weight`, `norm.weight` and `layers.{i}.*` (no embeddings, no head). Weights from an explicit generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def random_dflash(target_config, *, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                  intermediate: int = 64, block_size: int = 6, target_layer_ids: list[int] | None = None,
                  mask_token_id: int | None = None, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and tensors (published names) of a random DFlash draft for a target of transformers config
    `target_config` (`target_layer_ids` None: written as absent, the source's default applies)."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    n_ids = len(target_layer_ids) if target_layer_ids else layers if layers > 1 else 1

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(size, generator=g)

    t = {"fc.weight": normal(hidden, n_ids * hidden, std=(n_ids * hidden) ** -0.5), "hidden_norm.weight": norm(hidden),
         "norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden, std=hidden ** -0.5),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden, std=hidden ** -0.5),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden, std=hidden ** -0.5),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim, std=(heads * head_dim) ** -0.5),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": normal(intermediate, hidden, std=hidden ** -0.5),
            p + "mlp.up_proj.weight": normal(intermediate, hidden, std=hidden ** -0.5),
            p + "mlp.down_proj.weight": normal(hidden, intermediate, std=intermediate ** -0.5),
        })
    dflash_config = {"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "hidden_size": hidden,
              "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": layers, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "vocab_size": vocab, "attention_bias": False,
              "tie_word_embeddings": False, "block_size": block_size,
              "num_target_layers": target_config.num_hidden_layers, "dflash_config": dflash_config,
              "torch_dtype": "bfloat16"}
    return config, t


def save_dflash(config: dict, tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    """The draft as its checkpoint folder: config.json and model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: value.contiguous() for name, value in tensors.items()}, str(folder / "model.safetensors"))
    return folder
