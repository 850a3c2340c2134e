"""Triton kernels that fuse a static pass's small per-layer steps on the GPU (`graph_decoder.StaticDecoder`).

On a GPU a small model's captured pass is bound by how many kernels it runs, each a few microseconds however
little it does (docs/gpu.md): the torch formulas of a layer take about 20. Three fused kernels take the place
of 11 of them:

- `rotate_and_store`: q and k rotated in place in the joined q/k/v rows and the keys and values written to
  their cache slots (torch: a product, a roll, an `addcmul`, an `index_copy_`, and the copies between);
- `attend`: attention of every query row over a cache's first keys under an additive mask, split over the
  keys so that a one-token pass still fills the device (flash-decoding), then one kernel joins the splits
  and writes the heads in the layout the output projection reads (torch: `baddbmm`, softmax, `bmm`, and the
  permuting copy);
- `silu_mul`: SiLU(gate) · up (torch: two kernels).

Each computes in float32 and rounds its output once (attention's weights meet the values in the model's dtype, as
in flash attention). Triton is imported here only: `available(device)` says whether these
run (CUDA with Triton, unless `SPECDRAFT_FUSED_KERNELS=0`); with `TRITON_INTERPRET=1` set before Triton is first
imported (the tests' conftest does so on a machine without CUDA) and `SPECDRAFT_FUSED_KERNELS=1` they also run
on the CPU, as numpy.
"""

from __future__ import annotations

import os

import torch

from specdraft.kernels import numerics

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: the torch formulas run instead
    triton = None

KEY_SPLIT = 128  # keys one attention program reads: a 1,024-key pass runs 8 splits per key/value head ..
MAX_SPLITS = 32  # .. and a longer one at most this many, each reading more
KEY_BLOCK = 64  # keys per inner step of a split
ROW_BLOCK = 16  # query rows per attention program (the least a Triton matrix product takes)
MLP_BLOCK = 1024  # columns per SiLU·up program


def interpreted() -> bool:
    """Whether Triton runs its kernels on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fits(head_dim: int) -> bool:
    """Whether heads of `head_dim` suit the kernels (a power of two of at least 16: Triton's matrix products)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def available(device: torch.device) -> bool:
    """Whether the fused kernels run for tensors on `device`: on CUDA when Triton is installed, unless
    `SPECDRAFT_FUSED_KERNELS=0`; on the CPU only under Triton's interpreter with `SPECDRAFT_FUSED_KERNELS=1`."""
    setting = numerics.current().fused_kernels
    if triton is None or setting == "0":
        return False
    return device.type == "cuda" or (setting == "1" and interpreted())


if triton is not None:

    @triton.jit
    def _rotate_and_store(qkv, qkv_row, cos, sin, trig_row, slots, cache, cache_slot, cache_half,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, ALL: tl.constexpr):
        row = tl.program_id(0)
        heads = tl.arange(0, ALL)[:, None]  # [ALL, 1]: query heads, then key heads, then value heads (and padding)
        dims = tl.arange(0, D)[None, :]  # [1, D]
        real = heads < HEADS + 2 * KV_HEADS
        source = qkv + row * qkv_row + heads * D
        x = tl.load(source + dims, mask=real, other=0.0).to(tl.float32)  # [ALL, D]
        # x · cos + rotate_half(x) · sin, where rotate_half(x) = (-x[half:], x[:half])
        partner = tl.load(source + (dims + D // 2) % D, mask=real, other=0.0).to(tl.float32)
        c = tl.load(cos + row * trig_row + dims).to(tl.float32)
        s = tl.load(sin + row * trig_row + dims).to(tl.float32)
        rotated = x * c + tl.where(dims < D // 2, -partner, partner) * s
        tl.store(source + dims, rotated.to(qkv.dtype.element_ty), mask=heads < HEADS)
        slot = tl.load(slots + row)
        key = (heads >= HEADS) & (heads < HEADS + KV_HEADS)
        tl.store(cache + slot * cache_slot + (heads - HEADS) * D + dims, rotated.to(cache.dtype.element_ty), mask=key)
        value = (heads >= HEADS + KV_HEADS) & real
        tl.store(cache + slot * cache_slot + cache_half + (heads - HEADS - KV_HEADS) * D + dims,
                 x.to(cache.dtype.element_ty), mask=value)

    @triton.jit
    def _attend_split(qkv, qkv_row, cache, cache_slot, cache_half, mask, mask_row, partial, stats,
                      width, keys, span, scaling,
                      GROUPS: tl.constexpr, D: tl.constexpr, FLOAT32: tl.constexpr,
                      ROWS: tl.constexpr, KEYS: tl.constexpr):
        kv_head = tl.program_id(0)
        block = tl.program_id(1)
        split = tl.program_id(2)
        row_count = GROUPS * width  # query rows of this key/value head: row g·W + t is head (kv, g), token t
        rows = block * ROWS + tl.arange(0, ROWS)
        live = rows < row_count
        group, token = rows // width, rows % width
        dims = tl.arange(0, D)
        q = tl.load(qkv + token[:, None] * qkv_row + (kv_head * GROUPS + group)[:, None] * D + dims[None, :],
                    mask=live[:, None], other=0.0)  # [ROWS, D]
        top = tl.full((ROWS,), float("-inf"), tl.float32)
        total = tl.full((ROWS,), 0.0, tl.float32)
        acc = tl.full((ROWS, D), 0.0, tl.float32)
        for start in range(0, span, KEYS):
            columns = split * span + start + tl.arange(0, KEYS)
            inside = columns < keys
            k = tl.load(cache + columns[:, None] * cache_slot + kv_head * D + dims[None, :], mask=inside[:, None],
                        other=0.0)  # [KEYS, D]
            v = tl.load(cache + columns[:, None] * cache_slot + cache_half + kv_head * D + dims[None, :],
                        mask=inside[:, None], other=0.0)
            if FLOAT32:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))  # [ROWS, KEYS] float32
            bias = tl.load(mask + token[:, None] * mask_row + columns[None, :], mask=live[:, None] & inside[None, :],
                           other=float("-inf")).to(tl.float32)
            scores = scores * scaling + bias
            new_top = tl.maximum(top, tl.max(scores, 1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row with no key yet stays empty
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(top - shift)
            total = total * rescale + tl.sum(weights, 1)
            if FLOAT32:
                acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            top = new_top
        at = (split * tl.num_programs(0) + kv_head) * GROUPS * width + rows  # partial row of this split
        tl.store(partial + at[:, None] * D + dims[None, :], acc, mask=live[:, None])
        tl.store(stats + at * 2, top, mask=live)
        tl.store(stats + at * 2 + 1, total, mask=live)

    @triton.jit
    def _attend_join(partial, stats, out, out_row, width, splits, kv_heads,
                     GROUPS: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        kv_head = tl.program_id(0)
        row = tl.program_id(1)  # g·W + t
        group, token = row // width, row % width
        each = tl.arange(0, SPLITS)
        at = each * (kv_heads * GROUPS * width) + kv_head * GROUPS * width + row  # [SPLITS]: this row in each split
        real = each < splits
        tops = tl.load(stats + at * 2, mask=real, other=float("-inf"))
        top = tl.max(tops, 0)  # split 0 always holds a key the row sees
        weights = tl.where(tops == float("-inf"), 0.0, tl.exp(tops - top))  # a split of no keys weighs nothing
        total = tl.sum(weights * tl.load(stats + at * 2 + 1, mask=real, other=0.0), 0)
        dims = tl.arange(0, D)
        acc = tl.sum(weights[:, None] * tl.load(partial + at[:, None] * D + dims[None, :], mask=real[:, None],
                                                other=0.0), 0)  # [D]
        head = kv_head * GROUPS + group
        tl.store(out + token * out_row + head * D + dims, (acc / total).to(out.dtype.element_ty))

    @triton.jit
    def _silu_mul(gate_up, gate_up_row, out, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < inner
        gate = tl.load(gate_up + row * gate_up_row + columns, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * gate_up_row + inner + columns, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + row * inner + columns, (gate / (1.0 + tl.exp(-gate)) * up).to(out.dtype.element_ty),
                 mask=inside)


def rotate_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                     layer_states: torch.Tensor, heads: int, kv_heads: int) -> None:
    """Rotate the query heads of `qkv` [W, heads + 2 kv_heads, d] in place by `cos`, `sin` [W, d] (transformers'
    rotary formula), and write each row's rotated keys and its values to `layer_states` [S, 2, kv_heads, d] at
    `slots` [W]."""
    width, columns, d = qkv.shape
    assert qkv.stride(2) == 1 and qkv.stride(1) == d and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert layer_states.is_contiguous() and columns == heads + 2 * kv_heads
    _rotate_and_store[(width,)](qkv, qkv.stride(0), cos, sin, cos.stride(0), slots, layer_states,
                                layer_states.stride(0), layer_states.stride(1), HEADS=heads, KV_HEADS=kv_heads, D=d,
                                ALL=triton.next_power_of_2(columns))


def attend(qkv: torch.Tensor, layer_states: torch.Tensor, keys: int, mask: torch.Tensor, heads: int,
           scaling: float) -> torch.Tensor:
    """Attention of the query heads of `qkv` [W, heads + 2 kv_heads, d] over the first `keys` slots of
    `layer_states` [S, 2, kv_heads, d], row t seeing key j as `mask` [W, keys] (additive) says; returns
    [W, heads · d] in `qkv`'s dtype, the heads of a row side by side (the output projection's input)."""
    width, _, d = qkv.shape
    kv_heads = layer_states.shape[2]
    groups = heads // kv_heads
    splits = min(triton.cdiv(keys, KEY_SPLIT), MAX_SPLITS)
    span = triton.cdiv(triton.cdiv(keys, splits), KEY_BLOCK) * KEY_BLOCK  # keys a split reads
    rows = groups * width
    partial = torch.empty(splits * kv_heads * rows, d, dtype=torch.float32, device=qkv.device)
    stats = torch.empty(splits * kv_heads * rows, 2, dtype=torch.float32, device=qkv.device)
    _attend_split[(kv_heads, triton.cdiv(rows, ROW_BLOCK), splits)](
        qkv, qkv.stride(0), layer_states, layer_states.stride(0), layer_states.stride(1), mask, mask.stride(0),
        partial, stats, width, keys, span, scaling, GROUPS=groups, D=d, FLOAT32=qkv.dtype == torch.float32,
        ROWS=ROW_BLOCK, KEYS=KEY_BLOCK)
    out = torch.empty(width, heads * d, dtype=qkv.dtype, device=qkv.device)
    _attend_join[(kv_heads, rows)](partial, stats, out, out.stride(0), width, splits, kv_heads, GROUPS=groups, D=d,
                                   SPLITS=triton.next_power_of_2(splits))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up of `gate_up` [W, 2 I] (gate first): [W, I]."""
    width, double = gate_up.shape
    inner = double // 2
    out = torch.empty(width, inner, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul[(width, triton.cdiv(inner, MLP_BLOCK))](gate_up, gate_up.stride(0), out, inner, BLOCK=MLP_BLOCK)
    return out
