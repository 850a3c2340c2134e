"""The model families the packed GGUF path builds, each declared as data: what its files and layers differ in.

A GGUF file names its tensors as llama.cpp does (`blk.3.attn_q.weight`, placed at transformers' module paths); the
model that runs them is our own (`packed_model`) where every layer stacks, else the family's transformers class with
packed linears swapped in (`gguf_native`), and, where its layers have a declared shape, the stacked and fused layer
paths (`fast_layers`, `fused_decoder`). A family is one `Architecture`:

- `layer_tensors`: GGUF name inside `blk.N` -> module path inside `model.layers.N` (Gemma's `ffn_norm` is its
  pre-feed-forward norm, Llama's is the post-attention norm; Phi-3 keeps q, k, v and gate, up fused);
- `rotary_rows_interleaved`: llama.cpp's converter reorders the rows of q and k of Llama-type models for its
  rotary variant (pairs of adjacent dimensions); transformers rotates halves, so the loader puts the rows back;
- `norm_offset`: what the file adds to each norm weight (Gemma's norms multiply by 1 + w; the file holds 1 + w);
- `scaled_embedding`: the embedding is multiplied by sqrt(hidden) (Gemma);
- `layer_shape`: `"pre-norm"` where a layer is norm -> attention -> residual -> norm -> gated MLP -> residual
  (Llama, Mistral, Qwen2, Qwen3, Phi-3); `"sandwich"` where the attention's and the MLP's outputs are normed too,
  before their residual adds (Gemma 2, Gemma 3); both run on the stacked layers, and on the fused C stack where
  nothing else differs (`fused_decoder`); None: transformers' own layers; `LAYER_NORMS` names each shape's norms.
  Soft-caps are the config's (`attn_logit_softcapping` on the attention's scores, `final_logit_softcapping` on the
  logits: Gemma 2), computed by every path;
- `rms_norm`: `"llama"`, RMSNorm `w · bf16(x / rms(x))`; `"gemma"`, `bf16(x / rms(x) · (1 + w))` with both products
  in float32 (the 1 is `norm_offset`);
- `qk_norm`: an RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3);
- `rotary_per_layer_type`: each layer type (`config.layer_types`: full or sliding attention) has its own rotary
  table, which the model's rotary module computes given the type (Gemma 3: base 1M on full layers, 10k on sliding
  ones). Sliding windows themselves are the config's (`layer_types`, `sliding_window`), read per layer.

A family missing here still loads, through transformers' de-quantizer; `packed_obstacle` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                   "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# layer shape -> the layer's norms: before the attention, of the attention's output, before the MLP, of its output
LAYER_NORMS = {"pre-norm": ("input_layernorm", None, "post_attention_layernorm", None),
               "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                            "post_feedforward_layernorm")}
FREQUENCY_FACTORS = "rope_freqs"  # Llama 3.1+: per-pair divisors of the rotary frequencies
# Phi-3.5 / Phi-4-mini's LongRoPE factors, which `gguf_config` reads into the config's rotary parameters
LONGROPE_FACTORS = ("rope_factors_long", "rope_factors_short")


@dataclass(frozen=True)
class Architecture:
    """One family's differences (see the module's text)."""

    name: str  # GGUF `general.architecture`
    model_types: tuple[str, ...]  # transformers' `config.model_type` values it builds
    layer_tensors: dict[str, str]
    global_tensors: dict[str, str] = field(default_factory=lambda: dict(_GLOBAL_TENSORS))
    ignored_tensors: tuple[str, ...] = ()  # tensors the transformers model computes from its config
    rotary_rows_interleaved: bool = False
    norm_offset: float = 0.0
    scaled_embedding: bool = False
    layer_shape: str | None = "pre-norm"
    rms_norm: str = "llama"
    qk_norm: bool = False
    rotary_per_layer_type: bool = False

    def module_path(self, gguf_name: str) -> tuple[str, str] | None:
        """`blk.3.attn_q.bias` -> (`model.layers.3.self_attn.q_proj`, `bias`); None for an ignored tensor.

        Raises KeyError for a tensor the family does not have."""
        parts = gguf_name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in self.layer_tensors:
            return f"model.layers.{parts[1]}.{self.layer_tensors[parts[2]]}", parts[3]
        if len(parts) == 2 and parts[0] in self.global_tensors:
            return self.global_tensors[parts[0]], parts[1]
        if parts[0] in self.ignored_tensors or parts[0] == FREQUENCY_FACTORS:
            return None
        raise KeyError(gguf_name)


ARCHITECTURES = (
    Architecture("llama", ("llama", "mistral"), _ATTENTION | _MLP | _PRE_NORMS, rotary_rows_interleaved=True),
    Architecture("qwen2", ("qwen2",), _ATTENTION | _MLP | _PRE_NORMS),
    Architecture("qwen3", ("qwen3",), _ATTENTION | _MLP | _PRE_NORMS | _QK_NORMS, qk_norm=True),
    Architecture("phi3", ("phi3",), {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                                     "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"} | _PRE_NORMS),
    Architecture("gemma3", ("gemma3_text",), _ATTENTION | _MLP | _SANDWICH_NORMS | _QK_NORMS, norm_offset=1.0,
                 scaled_embedding=True, layer_shape="sandwich", rms_norm="gemma", qk_norm=True,
                 rotary_per_layer_type=True),
    Architecture("gemma2", ("gemma2",), _ATTENTION | _MLP | _SANDWICH_NORMS, norm_offset=1.0,
                 scaled_embedding=True, layer_shape="sandwich", rms_norm="gemma"),
)


def architecture_for(config) -> Architecture | None:
    """The declared family a transformers config belongs to, or None."""
    model_type = getattr(config, "model_type", None)
    return next((arch for arch in ARCHITECTURES if model_type in arch.model_types), None)


def known_model_types() -> list[str]:
    """Every transformers model type the packed path builds."""
    return [model_type for arch in ARCHITECTURES for model_type in arch.model_types]


def head_dim_of(config) -> int:
    """The width of one attention head (configs without `head_dim` split the hidden size evenly)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def stacked_architecture(config) -> Architecture | None:
    """The family's declaration where its layers have a shape the stacked layers take (see the module's text)."""
    arch = architecture_for(config)
    return arch if arch is not None and arch.layer_shape in LAYER_NORMS else None
