"""The names a published decoder layer (transformers' Llama and Qwen-3 layers) gives its tensors, after the layer's
prefix, and ours: what the EAGLE-3, MTP and DFlash loaders share (each adds the names only its checkpoints have)."""

DECODER_LAYER_NAMES = {  # published name (after the layer's prefix) -> ours
    "input_layernorm.weight": "input_layernorm.weight", "post_attention_layernorm.weight":
    "post_attention_layernorm.weight", "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight", "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight", "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.bias": "k_proj.bias", "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.bias": "o_proj.bias", "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight", "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight", "mlp.down_proj.weight": "down_proj.weight",
}
