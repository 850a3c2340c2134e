"""Attention for the CPU: transformers' `sdpa` with grouped key/value heads handed to SDPA.

With grouped-query attention (the bundled Qwen2.5 models: 12 or 14 query heads share 2
key/value heads) and an attention mask (every pass of more than one token after the first:
chain verification, tree passes, catch-up), transformers repeats each layer's cached keys
and values once per query head before calling SDPA, because SDPA's grouped mode with a mask
falls back to a slow kernel on CUDA. On the CPU the grouped mode with a mask is fast and
gives the same result bit for bit; the repeat copies the whole cache every layer and pass
(measured, one layer with a 1,000-token cache, bf16, 2 threads: 0.87 ms repeated vs 0.49 ms
grouped for 13 query tokens, 0.52 vs 0.15 ms for one).

A pass of a few query tokens over a cache (decoding, verification, tree passes) skips SDPA
altogether: PyTorch's CPU flash kernel costs about 1 µs per cached key for a single query
(measured, one layer, 12 query / 2 key-value heads of 128, bf16, 2 threads: 313 µs at 300
keys, 1,061 µs at 1,000, 2,049 µs at 2,000, about a fifth of a 1.5B model's decoding step),
while two float32 batched matmuls and a softmax cost 49, 145 and 187 µs and round only the
output to bf16 (`few_query_attention`).

Where the C kernel runs (CPU, bf16, batch 1) every pass takes it, prompt reads too: it computes
each token alone, so a prompt read in one pass, in chunks, or as a cached prefix and then the
rest gives the same bits (`attends_token_by_token`; what `prefix_cache` relies on). It is no
slower than SDPA there (one layer, 128 query tokens, 12 / 2 heads of 128, 2 threads, Zen 5,
ms: 0.32 / 1.60 / 3.24 / 7.39 against SDPA's 0.70 / 2.55 / 5.04 / 10.01 over 128 / 512 /
1,024 / 2,048 keys with AVX-512; 0.40 / 2.38 / 4.92 / 10.16 against 0.72 / 2.64 / 5.20 / 10.16
on AVX2), and prompt reads of the bundled 1.5B target took 3.27-3.63 ms a token against
3.44-4.07 with AVX-512 (512 and 1,500 tokens) and 7.43-8.27 against 7.74-8.31 on AVX2.
Elsewhere (float32, a GPU) passes of more than FEW_QUERIES tokens keep SDPA.

Soft-capped scores (Gemma 2's `attn_logit_softcapping`: `cap · tanh(score / cap)` before the mask) are computed here
on every pass, in C or in `few_query_attention`: SDPA cannot cap them, which is why transformers runs Gemma 2 on its
eager attention.

`use_grouped_sdpa(model)` switches a model whose attention is `sdpa` to this function, and a model transformers puts
on eager attention because its scores are soft-capped; everything it does not handle goes to transformers' own `sdpa`
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdraft.kernels import cache_attention

if TYPE_CHECKING:  # transformers' modeling is imported where a model is, not with this module
    from transformers import PreTrainedModel

# The name our attention is registered under. Not "sdpa" by name: transformers checks a model that asks for a name
# holding "sdpa" for SDPA support, which Gemma 2 (soft-capped scores) lacks, though its passes never reach SDPA here.
GROUPED_SDPA = "specdraft_grouped"
FEW_QUERIES = 64  # passes of at most this many query tokens over a cache skip SDPA


def few_query_attention(
    query: torch.Tensor,  # [B, heads, T, head_dim]
    key: torch.Tensor,  # [B, kv_heads, S, head_dim]
    value: torch.Tensor,  # [B, kv_heads, S, head_dim]
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] bool (True = attend) or additive; None = all visible
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, T, heads, head_dim] in the query's dtype
    """softmax(cap(q kᵀ · scaling) + mask) v in float32, each key/value head shared by its group of query heads
    (in C, each native library's `attention.h`, where it runs: bf16, batch 1); cap(s) = `softcap · tanh(s / softcap)`
    where `softcap` is given (Gemma 2), else s."""
    if cache_attention.supports(query, key, value):
        return cache_attention.attend(query, key, value, attention_mask, scaling, softcap)
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups * length, dim).float()  # query head h uses kv head h // groups
    scores = torch.matmul(grouped, key.float().transpose(-1, -2)).mul_(scaling)  # [B, kv_heads, groups · T, S]
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(batch, kv_heads, groups, length, keys)
    if attention_mask is not None:
        mask = attention_mask.view(attention_mask.shape[0], 1, 1, length, keys)
        if mask.dtype == torch.bool:  # the lowest finite score, not -inf: a fully hidden row (a batch's left
            # padding) stays finite, as in eager attention, instead of NaN that would reach other rows via V
            scores = scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores.add_(mask.float())
    weights = scores.softmax(dim=-1).view(batch, kv_heads, groups * length, keys)
    output = torch.matmul(weights, value.float())  # [B, kv_heads, groups · T, head_dim]
    return output.view(batch, heads, length, dim).transpose(1, 2).to(query.dtype).contiguous()


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, T, head_dim]
    key: torch.Tensor,  # [B, kv_heads, S, head_dim]
    value: torch.Tensor,  # [B, kv_heads, S, head_dim]
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, with `enable_gqa` on the CPU instead of repeated heads; soft-capped scores
    (`softcap`) on every device and pass here."""
    groups = getattr(module, "num_key_value_groups", 1)
    if softcap is None and (query.device.type != "cpu" or groups == 1 or kwargs.get("position_bias") is not None
                            or kwargs.get("cache") is not None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = length > 1 and attention_mask is None and causal
    # every pass on the kernel where it runs, and every soft-capped one; elsewhere a few queries over a cache
    if cache_attention.supports(query, key, value) or (length <= FEW_QUERIES and not causal) or softcap is not None:
        if causal:
            attention_mask = causal_visibility(length, key.shape[2], query.device)
        return few_query_attention(query, key, value, attention_mask, scaling or query.shape[-1] ** -0.5,
                                   softcap), None
    if causal and key.shape[2] > query.shape[2]:  # SDPA's causal mask is top-left aligned: only for a bare prefill
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )  # [B, heads, T, head_dim]
    return output.transpose(1, 2).contiguous(), None


def causal_visibility(length: int, keys: int, device: torch.device) -> torch.Tensor:  # [1, 1, T, S] bool
    """Which of `keys` keys each of the last `length` tokens sees in a causal pass: its own and every earlier one."""
    positions = torch.arange(keys - length, keys, device=device)  # [T]
    return (torch.arange(keys, device=device)[None, :] <= positions[:, None])[None, None]


def _register() -> None:
    """Register `grouped_sdpa_forward` (and SDPA's mask) with transformers under GROUPED_SDPA (again: a no-op)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def attends_token_by_token(model: PreTrainedModel, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether every pass of `model` (its states on `device` in `dtype`) attends on the C kernel, each token alone
    (`grouped_sdpa_forward`): then a prompt read in any split, e.g. a cached prefix and then the rest, gives the bits
    of one read."""
    config = model.config
    heads = config.num_attention_heads
    grouped = (getattr(config, "num_key_value_heads", None) or heads) < heads  # ungrouped heads keep transformers' sdpa
    return (getattr(config, "_attn_implementation", None) == GROUPED_SDPA and grouped
            and cache_attention.runs_on(device, dtype, head_dim))


def use_grouped_sdpa(model: PreTrainedModel) -> None:
    """Run `model`'s attention through `grouped_sdpa_forward` if it uses `sdpa`, or eager attention over soft-capped
    scores (Gemma 2: transformers' SDPA cannot cap them, ours does); else leave it."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    if attention == "sdpa" or (attention == "eager" and getattr(config, "attn_logit_softcapping", None) is not None):
        _register()
        model.set_attn_implementation(GROUPED_SDPA)
