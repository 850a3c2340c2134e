"""The GPU path of a decoder-only LM: a static KV cache, lean layers, and captured CUDA graphs per pass shape.

On a GPU a small model's pass is bound by launching kernels, not by reading weights: a 1.5B model's weights
take about a millisecond to read on an H100, while transformers' eager forward (a growing cache, masks built in
Python, about 40 kernels a layer) spent 17 ms a pass there. `StaticDecoder` runs the same function on a
`StaticCache`:

- the layers are written out over the model's own weights: q, k and v as one matrix (and gate and up as one),
  the module weights turned into views of the joined ones, so nothing is held twice; q and k are rotated in
  place and the keys and values go to the cache in one copy; the residual add rides in the output projections'
  matrix products (`addmm`); attention is transformers' eager formula over the cache's first slots, grouped
  query heads folded into the query rows (`_attend`);
- a pass of T tokens runs at the smallest bucketed width W >= T (`WIDTHS`) over the smallest bucketed key
  length that holds its slots (`key_buckets`: 256, 512, .. doubling): padding rows read token 0 and write
  their keys and values into the cache's scratch slots, and every real row is computed as it would be alone
  (rows never mix in matrix products, masks or norms);
- on CUDA each (width, key length) is captured once as a graph (`torch.cuda.CUDAGraph`), at load, with the
  tokens, positions, slots and mask as its input buffers; a pass copies its inputs in and replays. Wider
  passes (prompts) run the same function eagerly, unpadded. Elsewhere (the CPU, tests) every pass runs
  eagerly, padding included, so the bucketing logic is exercised everywhere.

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
KEY_BUCKET = 256  # the shortest key length a pass attends over; captured lengths double from here
DEFAULT_CAPACITY = 2048  # positions a cache holds at first (it grows, and graphs are recaptured, when needed)
LLAMA_STYLE = ("llama", "qwen2", "qwen3", "mistral")  # model types whose layers `StaticDecoder` writes out
assert WIDTHS[-1] <= SCRATCH_SLOTS
_captured = 0  # graphs captured in this process so far (`graphs_captured`)


def graphs_captured() -> int:
    """How many CUDA graphs this process has captured so far. A step during which the count moved paid for a
    capture (a pass's first width and key length after the cache grew, or a batch's cache made as requests came):
    its time is no pass's cost, and the policies do not learn from it."""
    return _captured


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
class _Inputs:
    """What a pass reads besides the weights and the cache."""

    tokens: torch.Tensor  # [W] int64
    positions: torch.Tensor  # [W] int64
    slots: torch.Tensor  # [W] int64: where each row's keys and values go
    mask: torch.Tensor  # [W, keys] additive, the model's dtype


@dataclass
class _Graph:
    """A captured pass of one width over one key length: its input buffers and output tensors."""

    graph: object  # torch.cuda.CUDAGraph
    inputs: _Inputs
    hidden: torch.Tensor  # [W, H] after the final norm
    logits: torch.Tensor  # [W, V]


class StaticDecoder:
    """A Llama-style model's pass over a `StaticCache`, captured per width on CUDA (see the module's text).

    `run(tokens, positions, length, visible)` writes the pass's states at slots `length ..` and returns the final
    hidden states and logits of its rows; the owner keeps `length` (the valid slots) and cuts it back itself.
    """

    def __init__(self, model: nn.Module, capacity: int = DEFAULT_CAPACITY, graphs: bool | None = None,
                 fused: bool | None = None) -> None:
        obstacle = static_obstacle(model)
        if obstacle is not None:
            raise ValueError(f"{type(model).__name__} cannot run on a static cache: {obstacle}")
        config, inner = model.config, model.model
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
        # the fused Triton kernels (rotation and cache write, attention, SiLU·up) in place of the torch formulas;
        # imported here, not with this module: importing Triton takes 0.3 s and 60 MB where no GPU will use it
        from specdraft.models import fused_kernels

        self.kernels = fused_kernels
        self.fused = fused_kernels.available(device) and fused_kernels.fits(self.head_dim) if fused is None else fused
        self.fused_mlp = self.fused and config.hidden_act in ("silu", "swish")
        self._graphs: dict[tuple[int, int], _Graph] = {}  # by (width, keys)
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
        self._key_minus_row = self._key_index.unsqueeze(0) - self._row_index.unsqueeze(1)  # [W_max, S]
        self._open = torch.zeros((), dtype=self.dtype, device=self.device)  # a visible key's mask value
        self._closed = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)

    @property
    def widest_graph(self) -> int | None:
        """The widest pass replayed from a captured graph (a wider one runs eagerly); None where none are captured."""
        return WIDTHS[-1] if self.use_graphs else None

    def key_buckets(self) -> list[int]:
        """The key lengths passes are captured for: 256, 512, .. below the capacity, then every slot."""
        buckets, keys = [], KEY_BUCKET
        while keys < self.cache.capacity:
            buckets.append(keys)
            keys *= 2
        return buckets + [self.cache.slots]

    # ----- the pass ------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _attend(self, q: torch.Tensor, index: int, keys: int, mask: torch.Tensor) -> torch.Tensor:
        """q [kv_heads, groups·W, d] over the first `keys` slots of layer `index`, under `mask` [groups·W, keys]:
        transformers' eager attention (scores in the model's dtype, softmax accumulated in float32), as matrix
        products over the cache's strided views. PyTorch's SDPA measured slower here, and its cuDNN backend
        failed replaying captured passes (docs/gpu.md)."""
        k, v = self.cache.keys(index, keys), self.cache.values(index, keys)  # [kv_heads, keys, d]
        scores = torch.baddbmm(mask.unsqueeze(0), q, k.transpose(1, 2), alpha=self.scaling)  # [kv_heads, gW, keys]
        return torch.bmm(scores.softmax(-1), v)  # [kv_heads, groups·W, d]

    def _pass(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
              head_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over `tokens` [W] at `positions` [W], writing their states to `slots` [W], each row seeing the
        first keys where `mask` [W, keys] is 0; returns the final hidden states [W, H] and the logits
        [head_rows, V] of the last rows."""
        width, d, kv_heads, groups, keys = tokens.shape[0], self.head_dim, self.kv_heads, self.groups, mask.shape[1]
        x = F.embedding(tokens, self.embedding)  # [W, H]
        cos, sin = self.rotary(x.unsqueeze(0), positions.unsqueeze(0))  # [1, W, d]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [W, d]
        if not self.fused:
            half = d // 2
            # rotate_half(x) · sin = roll(x, half) · (-sin | sin): one roll and one addcmul a layer for q and k
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)  # [W, 1, d]
            # query rows grouped by key/value head: row g·W + t is token t of query head (kv head, g)
            grouped_mask = mask.repeat(groups, 1)  # [groups·W, keys]
        q_heads, qk_heads = self.heads, self.heads + kv_heads
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(width, qk_heads + kv_heads, d)  # [W, heads + 2 kv, d]
            qk = qkv[:, :qk_heads]
            if layer.q_norm is not None:  # Qwen3: each head normed before its rotation
                normed = self._norm(qk[:, :q_heads], layer.q_norm), self._norm(qk[:, q_heads:], layer.k_norm)
                qk.copy_(torch.cat(normed, dim=1))
            if self.fused:
                states = self.cache.states[index]  # [S, 2, kv_heads, d]
                self.kernels.rotate_and_store(qkv, cos, sin, slots, states, q_heads, kv_heads)
                attended = self.kernels.attend(qkv, states, keys, mask, q_heads, self.scaling)  # [W, heads d]
            else:
                torch.addcmul(qk * cos.unsqueeze(1), torch.roll(qk, half, dims=-1), signed_sin, out=qk)  # in place
                self.cache.write(index, slots, qkv[:, q_heads:].view(width, 2, kv_heads, d))
                q = qkv[:, :q_heads].reshape(width, kv_heads, groups, d).permute(1, 2, 0, 3)  # [kv, groups, W, d]
                q = q.reshape(kv_heads, groups * width, d)
                attended = self._attend(q, index, keys, grouped_mask)  # [kv_heads, groups·W, d]
                attended = attended.view(kv_heads, groups, width, d).permute(2, 0, 1, 3).reshape(width, q_heads * d)
            x.addmm_(attended, layer.out.t())  # [W, H]: residual + o_proj, in place (no copy of x first)
            if layer.out_bias is not None:
                x = x + layer.out_bias
            h = self._norm(x, layer.post_norm)
            gate_up = F.linear(h, layer.gate_up, layer.gate_up_bias)  # [W, 2 I]
            if self.fused_mlp:
                inner = self.kernels.silu_mul(gate_up)  # [W, I]
            else:
                gate, up = gate_up.chunk(2, dim=-1)  # [W, I] each
                inner = layer.act(gate) * up
            x.addmm_(inner, layer.down.t())  # [W, H]: residual + down_proj
            if layer.down_bias is not None:
                x = x + layer.down_bias
        hidden = self._norm(x, self.final_norm)  # [W, H]
        return hidden, F.linear(hidden[width - head_rows :], self.head, self.head_bias)  # [head_rows, V]

    # ----- inputs of a pass ------------------------------------------------------------------
    def _inputs(self, width: int, keys: int) -> _Inputs:
        """Fresh input buffers of a pass of `width` rows over `keys` slots."""
        zeros = torch.zeros(3, width, dtype=torch.long, device=self.device)
        return _Inputs(zeros[0], zeros[1], zeros[2], torch.zeros(width, keys, dtype=self.dtype, device=self.device))

    def _fill(self, inputs: _Inputs, tokens: torch.Tensor, positions: torch.Tensor | None, length: int,
              visible: torch.Tensor | None) -> None:
        """Write a pass of `tokens` [T] at `positions` [T] (None: `length ..`) into `inputs` (width W >= T):
        slots `length ..` for the real rows, scratch slots and token 0 for the padding rows; the mask lets each
        row see the valid prefix, then the block causally (or as `visible` [T, n] says over the last n keys), and
        a padding row the keys up to its own row."""
        count, (width, keys) = tokens.shape[0], inputs.mask.shape
        inputs.tokens[:count] = tokens
        rows = self._row_index[:width] if width <= WIDTHS[-1] else torch.arange(width, device=self.device)
        torch.add(rows, length, out=inputs.slots)
        if positions is None:
            inputs.positions.copy_(inputs.slots)
        else:
            inputs.positions[:count] = positions
        if count < width:
            inputs.tokens[count:] = 0
            inputs.positions[count:] = 0
            inputs.slots[count:] += self.cache.scratch - length
        if width <= WIDTHS[-1]:  # key - row, precomputed
            allowed = self._key_minus_row[:width, :keys] <= length  # [W, keys]
        else:
            allowed = self._key_index[:keys].unsqueeze(0) - rows.unsqueeze(1) <= length
        if visible is not None:
            first = length + count - visible.shape[1]  # the first key `visible` covers
            allowed[:count] = self._key_index[:keys] < first
            allowed[:count, first : length + count] = visible
        torch.where(allowed, self._open, self._closed, out=inputs.mask)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor | None, length: int,
            visible: torch.Tensor | None = None, logits_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `tokens` [T] at `positions` [T] (None: `length ..`), writing slots `length .. length + T - 1`; returns the final hidden
        states [T, H] and the logits [logits_rows, V] of the last rows. Both may be buffers the next pass
        overwrites: copy what must outlive it."""
        count = tokens.shape[0]
        logits_rows = logits_rows or count
        self._make_room(length + count, length)
        width = next((w for w in WIDTHS if w >= count), None)
        if width is None:  # a prompt: eagerly, unpadded, over the keys it reaches
            inputs = self._inputs(count, length + count)
            self._fill(inputs, tokens, positions, length, visible)
            return self._pass(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, logits_rows)
        keys = next(k for k in self.key_buckets() if k >= length + count)
        if not self.use_graphs:
            inputs = self._inputs(width, keys)
            self._fill(inputs, tokens, positions, length, visible)
            hidden, logits = self._pass(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, width)
        else:
            graph = self._graphs.get((width, keys)) or self._capture(width, keys)
            self._fill(graph.inputs, tokens, positions, length, visible)
            graph.graph.replay()
            hidden, logits = graph.hidden, graph.logits
        return hidden[:count], logits[count - logits_rows : count]

    def append(self, length: int, other: "StaticDecoder", count: int) -> None:
        """Copy the first `count` slots of `other` (a decoder of the same model) to slots `length ..`: a prompt read
        into a cache of its own joins a packed batch's (`CausalLM.append_cache`)."""
        self._make_room(length + count, length)
        self.cache.states[:, length : length + count] = other.cache.states[:, :count]

    def _make_room(self, needed: int, length: int) -> None:
        """Grow the cache to hold `needed` positions, keeping its first `length`; its graphs are captured anew."""
        if needed <= self.cache.capacity:
            return
        self.cache.grow(needed, length)
        self._index_for(self.cache.slots)
        self._graphs.clear()
        self._pool = None  # a pool whose graphs are all gone cannot take new ones

    # ----- graphs -------------------------------------------------------------------------------
    def _capture(self, width: int, keys: int) -> _Graph:
        """Capture the pass of `width` tokens over `keys` slots; warm-up runs write only scratch slots."""
        global _captured
        _captured += 1
        inputs = self._inputs(width, keys)
        inputs.slots.copy_(self._row_index[:width] + self.cache.scratch)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._pass(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, logits = self._pass(inputs.tokens, inputs.positions, inputs.slots, inputs.mask, width)
        captured = _Graph(graph, inputs, hidden, logits)
        self._graphs[(width, keys)] = captured
        return captured

    def _capture_every(self, widths: tuple[int, ...]) -> None:
        with torch.inference_mode():
            for keys in sorted(self.key_buckets(), reverse=True):
                for width in sorted(widths, reverse=True):
                    if (width, keys) not in self._graphs:
                        self._capture(width, keys)

    def warm_up(self, widths: tuple[int, ...] = WIDTHS, quiet: bool = False) -> float:
        """Capture the graphs of `widths` over every key bucket now (widest first, so narrower ones reuse its
        memory); seconds taken. Does nothing off CUDA."""
        if not self.use_graphs:
            return 0.0
        started = time.perf_counter()
        try:
            self._capture_every(widths)
        except Exception as error:  # noqa: BLE001 - Triton could not build its kernels here (no C compiler, ..)
            if not self.fused:
                raise
            print(f"specdraft: the fused GPU kernels failed to build ({type(error).__name__}: {error}); running "
                  "the torch formulas instead (SPECDRAFT_FUSED_KERNELS=0 skips them)", file=sys.stderr)
            self.fused = self.fused_mlp = False
            self._graphs.clear()
            self._capture_every(widths)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        if not quiet:
            print(f"captured CUDA graphs for passes of {', '.join(map(str, sorted(widths)))} tokens over "
                  f"{', '.join(map(str, self.key_buckets()))} cached keys in {seconds:.1f} s", file=sys.stderr)
        return seconds
