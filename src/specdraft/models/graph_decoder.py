"""The GPU path of a decoder-only LM: a static KV cache, lean layers, and one captured CUDA graph per pass width.

On a GPU a small model's pass is bound by launching kernels, not by reading weights: a 1.5B model's weights
take under a millisecond to read on an H100, while transformers' eager forward (a growing cache, masks built
in Python, about 40 kernels a layer) spends 15-20 ms a pass in Python and launches. `StaticDecoder` runs the
same function on a `StaticCache`:

- the layers are written out over the model's own weights: q, k and v as one matrix (and gate and up as one),
  the module weights turned into views of the joined ones, so nothing is held twice; the residual add rides
  in the output projections' matrix products (`addmm`); attention is SDPA over every slot of the cache with
  an additive mask, grouped query heads folded into the query rows;
- a pass of T tokens runs at the smallest bucketed width W >= T (`WIDTHS`): padding rows read token 0 and
  write their keys and values into the cache's scratch slots, and every real row is computed as it would be
  alone (rows never mix in matrix products, masks or norms);
- on CUDA each width is captured once as a graph (`torch.cuda.CUDAGraph`), with the tokens, positions, slots
  and mask as its input buffers; a pass copies its inputs in and replays. Wider passes (prompts) run the same
  function eagerly, unpadded. Elsewhere (the CPU, tests) every pass runs eagerly, padding included, so the
  bucketing logic is exercised everywhere.

A model qualifies when `static_obstacle(model)` is None: Llama-style layers (RMSNorm, rotary, grouped-query
attention, gated MLP) built from plain `nn.Linear` projections, full attention in every layer.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.models.static_cache import SCRATCH_SLOTS, StaticCache

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # pass widths captured as graphs; wider passes run eagerly
DEFAULT_CAPACITY = 2048  # positions a cache holds at first (it grows, and graphs are recaptured, when needed)
LLAMA_STYLE = ("llama", "qwen2", "qwen3", "mistral")  # model types whose layers `StaticDecoder` writes out
assert WIDTHS[-1] <= SCRATCH_SLOTS


def static_obstacle(model: nn.Module) -> str | None:
    """Why `model` cannot run on a `StaticDecoder`, or None when it can."""
    config = model.config
    if config.model_type not in LLAMA_STYLE:
        return f"model type {config.model_type!r} is not one of {', '.join(LLAMA_STYLE)}"
    kinds = getattr(config, "layer_types", None)
    windowed = any(kind != "full_attention" for kind in kinds) if kinds is not None else bool(
        getattr(config, "sliding_window", None))
    if windowed:
        return "it has sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        return "its rotary embedding rescales with the sequence length"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or type(inner.embed_tokens) is not nn.Embedding:
        return "it has no rotary embedding or plain token embedding where Llama-style models keep them"
    if type(model.get_output_embeddings()) is not nn.Linear:
        return "its LM head is not a plain linear layer"
    for layer in inner.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
            getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(p) is not nn.Linear for p in projections):
            return "a projection is not a plain nn.Linear (packed or quantized weights run on the CPU kernels)"
    return None


def _joined(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight `[sum out, in]` (and bias) for projections of the same input; each module's weight becomes a
    view of it (weights already laid out so are only viewed)."""
    weights = [linear.weight.data for linear in linears]
    rows = [w.shape[0] for w in weights]
    first = weights[0]
    adjacent = all(w.is_contiguous() for w in weights) and all(
        w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and w.data_ptr() == first.data_ptr() + sum(rows[:i]) * first.shape[1] * first.element_size()
        for i, w in enumerate(weights))
    if adjacent:
        joined = first.as_strided((sum(rows), first.shape[1]), (first.shape[1], 1))
    else:
        joined = torch.cat(weights)
        for linear, part in zip(linears, joined.split(rows)):
            linear.weight.data = part
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return joined, None
    bias = torch.cat([b.data if b is not None else first.new_zeros(r) for b, r in zip(biases, rows)])
    return joined, bias


@dataclass
class _Layer:
    """One decoder layer's weights, laid out for the pass."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(heads + 2 kv_heads) d, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [d] (Qwen3's per-head norms)
    k_norm: torch.Tensor | None
    out: torch.Tensor  # [H, heads d]
    out_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None
    act: nn.Module


@dataclass
class _Graph:
    """A captured pass of one width: its input buffers and output tensors."""

    graph: object  # torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [W] int64
    positions: torch.Tensor  # [W] int64
    slots: torch.Tensor  # [W] int64
    mask: torch.Tensor  # [W, S] additive, the model's dtype
    hidden: torch.Tensor  # [W, H] after the final norm
    logits: torch.Tensor  # [W, V]


class StaticDecoder:
    """A Llama-style model's pass over a `StaticCache`, captured per width on CUDA (see the module's text).

    `run(tokens, positions, length, visible)` writes the pass's states at slots `length ..` and returns the final
    hidden states and logits of its rows; the owner keeps `length` (the valid slots) and cuts it back itself.
    """

    def __init__(self, model: nn.Module, capacity: int = DEFAULT_CAPACITY, graphs: bool | None = None,
                 compiled: bool = False) -> None:
        obstacle = static_obstacle(model)
        if obstacle is not None:
            raise ValueError(f"{type(model).__name__} cannot run on a static cache: {obstacle}")
        config, inner = model.config, model.model
        self.model = model
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = first.scaling
        self.eps = config.rms_norm_eps
        self.embedding = inner.embed_tokens.weight  # [V, H]
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        head = model.get_output_embeddings()
        self.head, self.head_bias = head.weight, head.bias  # [V, H]
        self.layers = [self._layer(layer) for layer in inner.layers]
        device, dtype = self.embedding.device, self.embedding.dtype
        self.device, self.dtype = device, dtype
        capacity = min(capacity, getattr(config, "max_position_embeddings", None) or capacity)
        self.cache = StaticCache(len(self.layers), self.kv_heads, self.head_dim, capacity, dtype, device)
        self.use_graphs = device.type == "cuda" if graphs is None else graphs and device.type == "cuda"
        self._graphs: dict[int, _Graph] = {}
        # `compiled`: the captured passes run torch.compile's fused kernels (one compile per width)
        self._graphed_pass = torch.compile(self._pass, dynamic=False) if compiled else self._pass
        self._pool = None
        self._index_for(self.cache.slots)

    def _layer(self, layer: nn.Module) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _joined([attention.q_proj, attention.k_proj, attention.v_proj])
        gate_up, gate_up_bias = _joined([mlp.gate_proj, mlp.up_proj])
        norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        return _Layer(layer.input_layernorm.weight, qkv, qkv_bias,
                      None if norm[0] is None else norm[0].weight, None if norm[1] is None else norm[1].weight,
                      attention.o_proj.weight, attention.o_proj.bias, layer.post_attention_layernorm.weight,
                      gate_up, gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias, mlp.act_fn)

    def _index_for(self, slots: int) -> None:
        self._key_index = torch.arange(slots, device=self.device)  # [S]
        self._row_index = torch.arange(WIDTHS[-1], device=self.device)  # [W_max]

    # ----- the pass ------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x: [W, heads, d]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _pass(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
              head_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over `tokens` [W] at `positions` [W], writing their states to `slots` [W], each row seeing the
        keys `mask` [W, S] leaves at 0; returns the final hidden states [W, H] and the logits [head_rows, V] of the
        last rows."""
        width, d, kv_heads, groups = tokens.shape[0], self.head_dim, self.kv_heads, self.groups
        x = F.embedding(tokens, self.embedding)  # [W, H]
        cos, sin = self.rotary(x.unsqueeze(0), positions.unsqueeze(0))  # [1, W, d]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [W, 1, d]
        # query rows grouped by key/value head: row g·W + t is token t of query head (kv head, g)
        grouped_mask = mask.repeat(groups, 1).unsqueeze(0).unsqueeze(0)  # [1, 1, groups·W, S]
        q_width, kv_width = self.heads * d, kv_heads * d
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [W, (heads + 2 kv_heads) d]
            q = qkv[:, :q_width].view(width, self.heads, d)
            k = qkv[:, q_width : q_width + kv_width].view(width, kv_heads, d)
            v = qkv[:, q_width + kv_width :].view(width, kv_heads, d)
            if layer.q_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            self.cache.write(index, slots, k, v)
            q = q.view(width, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(1, kv_heads, groups * width, d)
            attended = F.scaled_dot_product_attention(
                q, self.cache.keys[index].unsqueeze(0), self.cache.values[index].unsqueeze(0),
                attn_mask=grouped_mask, scale=self.scaling)  # [1, kv_heads, groups·W, d]
            attended = attended.view(kv_heads, groups, width, d).permute(2, 0, 1, 3).reshape(width, q_width)
            x = torch.addmm(x, attended, layer.out.t())  # [W, H]: residual + o_proj
            if layer.out_bias is not None:
                x = x + layer.out_bias
            h = self._norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)  # [W, I] each
            x = torch.addmm(x, layer.act(gate) * up, layer.down.t())  # [W, H]: residual + down_proj
            if layer.down_bias is not None:
                x = x + layer.down_bias
        hidden = self._norm(x, self.final_norm)  # [W, H]
        return hidden, F.linear(hidden[width - head_rows :], self.head, self.head_bias)  # [head_rows, V]

    # ----- inputs of a pass ------------------------------------------------------------------
    def _mask(self, width: int, length: int, count: int, visible: torch.Tensor | None) -> torch.Tensor:
        """Additive mask [width, S] for `count` real rows written at `length ..`: the valid prefix, then causal
        (or `visible` [count, n] over the last n keys); padding rows see the keys up to their own row."""
        rows = (self._row_index[:width] if width <= WIDTHS[-1] else torch.arange(width, device=self.device)).unsqueeze(1)
        allowed = self._key_index.unsqueeze(0) <= rows + length  # [W, S] causal, padding rows included
        if visible is not None:
            allowed[:count] = self._key_index.unsqueeze(0) < length + count - visible.shape[1]
            allowed[:count, length + count - visible.shape[1] : length + count] = visible
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def _slots(self, width: int, length: int, count: int) -> torch.Tensor:
        """Slots `length ..` for the real rows, scratch slots for the padding rows. # [W]"""
        rows = self._row_index[:width]
        return torch.where(rows < count, rows + length, rows + self.cache.scratch)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, length: int, visible: torch.Tensor | None = None,
            logits_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `tokens` [T] at `positions` [T], writing slots `length .. length + T - 1`; returns the final hidden
        states [T, H] and the logits [logits_rows, V] of the last rows. Both may be buffers the next pass
        overwrites: copy what must outlive it."""
        count = tokens.shape[0]
        logits_rows = logits_rows or count
        if length + count > self.cache.capacity:
            self.cache.grow(length + count, length)
            self._index_for(self.cache.slots)
            self._graphs.clear()
        width = next((w for w in WIDTHS if w >= count), None)
        if width is None:  # a prompt: eagerly, unpadded
            slots = torch.arange(length, length + count, device=self.device)
            hidden, logits = self._pass(tokens, positions, slots, self._mask(count, length, count, visible), logits_rows)
            return hidden, logits
        mask = self._mask(width, length, count, visible)
        slots = self._slots(width, length, count)
        if not self.use_graphs:
            padded = torch.zeros(width, dtype=torch.long, device=self.device)
            padded_tokens, padded_positions = padded.clone(), padded
            padded_tokens[:count], padded_positions[:count] = tokens, positions
            hidden, logits = self._pass(padded_tokens, padded_positions, slots, mask, width)
        else:
            graph = self._graphs.get(width) or self._capture(width)
            graph.tokens.zero_()
            graph.positions.zero_()
            graph.tokens[:count].copy_(tokens)
            graph.positions[:count].copy_(positions)
            graph.slots.copy_(slots)
            graph.mask.copy_(mask)
            graph.graph.replay()
            hidden, logits = graph.hidden, graph.logits
        return hidden[:count], logits[count - logits_rows : count]

    # ----- graphs -------------------------------------------------------------------------------
    def _capture(self, width: int) -> _Graph:
        """Capture the pass of `width` tokens; warm-up runs write only scratch slots."""
        tokens = torch.zeros(width, dtype=torch.long, device=self.device)
        positions = torch.zeros(width, dtype=torch.long, device=self.device)
        slots = self._row_index[:width] + self.cache.scratch
        mask = torch.zeros(width, self.cache.slots, dtype=self.dtype, device=self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._graphed_pass(tokens, positions, slots, mask, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, logits = self._graphed_pass(tokens, positions, slots, mask, width)
        captured = _Graph(graph, tokens, positions, slots, mask, hidden, logits)
        self._graphs[width] = captured
        return captured

    def warm_up(self, widths: tuple[int, ...] = WIDTHS, quiet: bool = False) -> float:
        """Capture the graphs of `widths` now (widest first, so narrower ones reuse its memory); seconds taken.
        Does nothing off CUDA."""
        if not self.use_graphs:
            return 0.0
        started = time.perf_counter()
        with torch.inference_mode():
            for width in sorted(widths, reverse=True):
                if width not in self._graphs:
                    self._capture(width)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        if not quiet:
            print(f"captured CUDA graphs for passes of {', '.join(map(str, sorted(widths)))} tokens "
                  f"in {seconds:.1f} s", file=sys.stderr)
        return seconds
