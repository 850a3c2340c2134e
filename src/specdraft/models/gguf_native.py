"""Build a model straight from a GGUF file's blocks, without unpacking it to bf16.

- Q4_K and Q5_K linears keep the file's blocks (codes, 6-bit scales and mins, fp16 d and dmin:
  `kernels/q4k_tiles.Q4KLinear`, llama.cpp's numerics, int8 activations per 256 inputs on every pass) where the AVX2
  or AVX-512 tile kernel runs.
- Q4_0 and Q5_0 linears keep the file's blocks too (codes and fp16 d: `kernels/q4k_tiles.Q40Linear`, int8
  activations per 32 inputs) where the AVX2 or AVX-512 tile kernel runs. A draft (`split=False`) has its Q5_0 and
  Q5_K rows unpacked, for `prepare_draft` to re-quantize to plain 4 bits (they cost it more as stored).
- Other 4-bit affine linears (Q4_1; Q4_0 and Q4_K on AMX) run with the file's own scales and offsets
  (`Int4Linear.from_affine`) on our AMX kernel (`kernels/tiles.AMX`) where the CPU grants AMX,
  else on our AVX-512 or AVX2 kernels, else on PyTorch's CPU int4 kernel: exact up to bf16 rounding
  of each group's scale and offset.
- Q6_K linears keep the file's bits, repacked into tiles (`kernels/gguf_matmul.pack_q6k`), on the
  tile kernels where they build and run; elsewhere they are unpacked.
- Q8_0, IQ4_NL and IQ4_XS linears keep the file's codes (IQ4: its indices) and steps (`kernels/int8_codes.CodeLinear`,
  8.5 and 5 bits a weight, on int16 activations on every pass) where the AVX2 or AVX-512 tile kernel runs.
- Q5_1 linears (and Q5_0 and Q5_K on AMX) keep their 5-bit codes in 5-bit tiles (`Int4Linear(bits=5)`, 6 bits a
  weight) where a tile kernel runs (AMX, AVX-512, AVX2); Q8_0 linears on AMX (and 5-bit ones on PyTorch's kernel) split each code into its
  top bits and low nibble: two 4-bit matrices side by side (`SplitInt4Linear`, 10 bits a weight), exact like the
  4-bit ones, on the same kernels; IQ4_NL and IQ4_XS the same, with the int8 value each nibble stands for as the
  code (llama.cpp's 16-value table; IQ4_XS's 6-bit sub-block scales times d as each group's step).
- F16, BF16 and F32 linears keep the file's elements, multiplied in float32 (`kernels/dense_matmul.DenseLinear`)
  where the AVX2 or AVX-512 tile kernel runs: a bf16 model would otherwise round F16 and F32 and run BF16 on PyTorch's GEMM,
  whose roundings depend on the pass width. On AMX they are unpacked to bf16 as below
  (`dense_matmul.available`). A draft that `prepare_draft` re-quantizes (`split=False`) has them unpacked.
- Other linears (Q2_K, Q3_K, ...) have no kernel here and are unpacked to the model's
  dtype (a draft's `prepare_draft(..., "int4")` then re-quantizes them: lossy but cheap,
  and it never changes what is emitted).
- The token embedding stays in its file blocks and unpacks only the rows looked up.

`models/architectures.py` declares, per family, the tensor names and what llama.cpp's converter changed (Llama's
q/k row order, Gemma's norm offsets). Where every layer's q|k|v and gate|up run on tile kernels and its rotary is
fixed and turns whole heads (`stack_layers`), the model is our own (`packed_model.PackedForCausalLM`: no transformers
model code is imported, and what is kept holds the layers stacked); elsewhere it is the family's transformers class,
built on the meta device and filled tensor by tensor. Either way memory never holds an unpacked copy of the whole
file. Families not declared load unpacked through transformers.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict, defaultdict
from pathlib import Path

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.kernels import dense_matmul, gguf_matmul, int8_codes, q4k_tiles
from specdraft.kernels.int4_layout import AffineRows
from specdraft.models.architectures import (FREQUENCY_FACTORS, LAYER_NORMS, LONGROPE_FACTORS, Architecture,
                                            architecture_for, head_dim_of, known_model_types)
from specdraft.models import packed_model
from specdraft.models.fast_layers import (CODE_MATMULS, STORED_LINEARS, StackedAttention, StackedMLP,
                                          StackedProjection, run_kind, fast_decoder_layers)
from specdraft.models.gguf_header import TensorEntry, read_header
from specdraft.gguf_layout import Q4K_GROUP  # every affine type groups 32 weights
from specdraft.models.gguf_blocks import (AFFINE_4BIT, FIVE_BIT, SPLIT_INTO_4BIT, five_bit_affine, q4_affine,
                                          q4_0_stored, q4k_stored, stored_codes, split_affine, unpack_rows)
from specdraft.models import packed_store
from specdraft.models.heap import trim_heap
from specdraft.models.quantize import Int4Linear, SplitInt4Linear, five_bit_tiles_run, int4_kernel_available

_EMBEDDING = "model.embed_tokens"
RECENT_ROWS = 512  # embedding rows kept for single-token lookups (1-3 MB at hidden sizes 896-3072)
_ROWS_PER_SLICE = 16384  # rows unpacked at a time, so no whole float32 copy of a big matrix exists


class PackedEmbedding(nn.Module):
    """An embedding table kept in its GGUF blocks in the file (`_TensorFile.table_rows`): a lookup reads the rows it
    needs with positioned reads and unpacks them (times `scale`, rounded to the model's dtype first, as Gemma's scaled
    embedding multiplies). Nothing of the table is mapped, so only the page cache, never the process, holds it: a
    mapped table grew the process by the file's large folios (about 1.5 MB a distinct token on ext4, kernel 6.18)."""

    def __init__(self, table: "TableRows", type_name: str, dim: int, dtype: torch.dtype,
                 scale: float | None = None) -> None:
        super().__init__()
        self.table, self.type_name, self.embedding_dim, self.out_dtype = table, type_name, dim, dtype
        self.num_embeddings = table.rows
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(dtype)
        self._recent: OrderedDict[int, torch.Tensor] = OrderedDict()  # token id -> its row [dim], last used last

    def num_packed_weights(self) -> int:
        """How many weights the packed table holds."""
        return self.num_embeddings * self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [...] -> [..., dim]
        if not ids.numel():
            return torch.empty((*ids.shape, self.embedding_dim), dtype=self.out_dtype, device=ids.device)
        if ids.numel() == 1:  # a decoding step's token: its row kept from an earlier step, or read and kept
            return self._recent_row(int(ids.reshape(-1)[0])).view(*ids.shape, self.embedding_dim).to(ids.device)
        return self._rows(ids)

    def _recent_row(self, token: int) -> torch.Tensor:
        """Token `token`'s row `[dim]`, a copy (the caller may write into it): one of the `RECENT_ROWS` last asked for
        is kept, so a decoding step skips the read and unpacking (up to 0.5 ms of Python and small tensor operations
        right after a pass, whose weights pushed the interpreter's data out of the caches: a 0.5B draft's step 1.4%
        faster)."""
        row = self._recent.get(token)
        if row is None:
            row = self._rows(torch.tensor([token]))[0]
            self._recent[token] = row
            if len(self._recent) > RECENT_ROWS:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(token)
        return row.clone()

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [...] -> [..., dim], read from the file
        wanted, where = torch.unique(ids.reshape(-1).cpu(), return_inverse=True)  # [u] sorted, [n] into them
        rows = unpack_rows(self.table.read(wanted), self.type_name, self.embedding_dim)[where]  # [n, dim] float32
        rows = rows.to(self.out_dtype)
        if self.scale is not None:
            rows = rows * self.scale
        return rows.view(*ids.shape, self.embedding_dim).to(ids.device)


class TableRows:
    """The raw rows `[rows, row_bytes]` of one matrix in a file, read on demand with positioned reads (`os.preadv`:
    no shared file position, so threads and forked workers read at once)."""

    def __init__(self, path: Path, offset: int, rows: int, row_bytes: int) -> None:
        self.path, self.offset, self.rows, self.row_bytes = path, offset, rows, row_bytes
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (sorted, distinct, int64 `[u]`) as uint8 `[u, row_bytes]`: one read per run of adjacent ids."""
        if not ids.numel():
            return torch.empty((0, self.row_bytes), dtype=torch.uint8)
        if int(ids[0]) < 0 or int(ids[-1]) >= self.rows:
            raise IndexError(f"token ids must lie in [0, {self.rows}); got {int(ids[0])} .. {int(ids[-1])}")
        out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8)
        buffer = out.numpy()
        breaks = (torch.nonzero(ids[1:] - ids[:-1] != 1).flatten() + 1).tolist()
        for first, stop in zip([0] + breaks, breaks + [ids.numel()]):
            want = (stop - first) * self.row_bytes
            if os.preadv(self._fd, [buffer[first:stop]], self.offset + int(ids[first]) * self.row_bytes) != want:
                raise SpecdraftError(f"{self.path} ends inside a table it was read from: it changed or was cut.")
        return out

    def __getstate__(self) -> dict:  # a copy (or an unpickled one) opens the file anew
        return {name: value for name, value in self.__dict__.items() if name != "_fd"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


class FlatLinear(nn.Linear):
    """`nn.Linear` that multiplies a 2-D contiguous view: a strided 3-D input (the last
    positions of a pass, sliced for the LM head) otherwise takes a batched path that copies
    the whole weight on every call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        out = super().forward(x.reshape(-1, x.shape[-1]).contiguous())  # [tokens, N]
        return out.view(*x.shape[:-1], self.out_features)


class _TensorFile:
    """Reads tensors' bytes with plain reads (no memory map of the file, so nothing of it stays resident), or hands
    out one table whose rows are read when looked up (the embedding)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "rb")

    def rows(self, entry: TensorEntry, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows `start:stop` of a matrix as raw bytes `[rows, bytes per row]` (uint8)."""
        total = entry.shape[0] if len(entry.shape) > 1 else 1
        stop = total if stop is None else min(stop, total)
        row_bytes = entry.n_bytes // total
        out = torch.empty((stop - start, row_bytes), dtype=torch.uint8)
        self.file.seek(entry.offset + start * row_bytes)
        if self.file.readinto(out.numpy()) != out.numel():
            raise SpecdraftError(f"The GGUF file ends inside tensor {entry.name!r}: it is truncated.")
        return out

    def table_rows(self, entry: TensorEntry) -> TableRows:
        """A matrix's raw rows, each read from the file when looked up (a 262k-row embedding table costs only the
        rows looked up, and those only as long as a lookup holds them)."""
        rows = entry.shape[0] if len(entry.shape) > 1 else 1
        if os.path.getsize(self.file.name) < entry.offset + entry.n_bytes:
            raise SpecdraftError(f"The GGUF file ends inside tensor {entry.name!r}: it is truncated.")
        return TableRows(Path(self.file.name), entry.offset, rows, entry.n_bytes // rows)

    def lazy_rows(self, entry: TensorEntry) -> "_LazyRows":
        """A matrix's raw rows that are read from the file only when sliced (for packing big ones)."""
        return _LazyRows(self, entry)

    def unpacked(self, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
        """A whole tensor as `dtype`, unpacked slice by slice (a matrix is [out, in])."""
        if len(entry.shape) == 1:
            return unpack_rows(self.rows(entry), entry.type_name, entry.shape[0]).view(entry.shape).to(dtype)
        out = torch.empty(entry.shape, dtype=dtype)
        for i in range(0, entry.shape[0], _ROWS_PER_SLICE):
            out[i:i + _ROWS_PER_SLICE] = unpack_rows(self.rows(entry, i, i + _ROWS_PER_SLICE), entry.type_name,
                                                     entry.shape[1]).to(dtype)
        return out

    def close(self) -> None:
        self.file.close()


class _LazyRows:
    """Raw rows `[rows, bytes per row]` (uint8) of one matrix; `[start:stop]` reads them from the file."""

    dtype = torch.uint8

    def __init__(self, source: _TensorFile, entry: TensorEntry) -> None:
        self.source, self.entry = source, entry
        self.shape = (entry.shape[0], entry.n_bytes // entry.shape[0])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.source.rows(self.entry, rows.start or 0, rows.stop)


def _affine_rows(raw, type_name: str, convert) -> AffineRows:
    """`convert` (`q4_affine` or `split_affine`) of raw rows `[N, bytes per row]` (a tensor or `_LazyRows`) as the
    packer asks for them, a slice at a time: no whole copy of the codes exists (a 262k-row tied head's int16 codes
    took 1.2 GB more)."""
    return lambda start, stop: convert(raw[start:stop], type_name)


def _linear(source: _TensorFile, weight: TensorEntry, bias: torch.Tensor | None, dtype: torch.dtype,
            pack: bool, order: torch.Tensor | None = None, split: bool = True) -> nn.Module:
    """The module for one GGUF linear: packed for the 4-bit affine types, those that split into two 4-bit
    halves and Q6_K (where their kernels run), else unpacked. `order` [out] says which file row each output row is (None: the file's order)."""
    out_features, in_features = weight.shape
    if bias is not None and order is not None:
        bias = bias[order]
    raw = source.lazy_rows(weight) if order is None or not pack else source.rows(weight)[order]  # [N, bytes per row]
    five_bit = weight.type_name in ("Q5_K", "Q5_0")  # a draft (split False) re-quantizes them to plain 4 bits, as before
    if (pack and weight.type_name in q4k_tiles.BITS and out_features % 16 == 0 and q4k_tiles.available()
            and (split or not five_bit)):
        return q4k_tiles.Q4KLinear(_affine_rows(raw, weight.type_name, q4k_stored), out_features, in_features, bias,
                                   weight.type_name)
    if (pack and weight.type_name in q4k_tiles.GROUP_BITS and out_features % 16 == 0 and q4k_tiles.available()
            and (split or not five_bit)):
        return q4k_tiles.Q40Linear(_affine_rows(raw, weight.type_name, q4_0_stored), out_features, in_features, bias,
                                    weight.type_name)
    if pack and weight.type_name in AFFINE_4BIT and out_features % 16 == 0 and int4_kernel_available():
        return Int4Linear(_affine_rows(raw, weight.type_name, q4_affine), out_features, in_features, Q4K_GROUP, bias)
    if pack and split and weight.type_name in FIVE_BIT and five_bit_tiles_run(out_features, in_features):
        return Int4Linear(_affine_rows(raw, weight.type_name, five_bit_affine), out_features, in_features, Q4K_GROUP,
                          bias, bits=5)
    if pack and split and weight.type_name in int8_codes.TYPES and out_features % 16 == 0 and int8_codes.available():
        return int8_codes.CodeLinear(_affine_rows(raw, weight.type_name, stored_codes), out_features, in_features,
                                     weight.type_name, bias)
    if pack and split and weight.type_name in SPLIT_INTO_4BIT and out_features % 16 == 0 and int4_kernel_available():
        halves = Int4Linear(_affine_rows(raw, weight.type_name, split_affine), out_features, 2 * in_features,
                            Q4K_GROUP, bias)
        return SplitInt4Linear(halves)
    if pack and weight.type_name in gguf_matmul.BLOCK_BYTES and gguf_matmul.available():
        return gguf_matmul.BlockLinear(raw, weight.type_name, bias)
    if (pack and split and weight.type_name in dense_matmul.ELEMENT_BYTES and out_features % 16 == 0
            and dense_matmul.available()):
        return dense_matmul.DenseLinear(raw[:], weight.type_name, bias)  # read whole: its elements are only reordered
    with torch.device("meta"):
        linear = FlatLinear(in_features, out_features, bias=bias is not None)
    unpacked = source.unpacked(weight, dtype)  # [N, K]
    linear.weight = nn.Parameter(unpacked if order is None else unpacked[order], requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return linear


def _rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """For q or k of `heads` heads stored in llama.cpp's rotary order (each head's dimensions as adjacent pairs),
    the file row of each row in transformers' order (each head's first halves, then its second halves) `[rows]`."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _row_order(arch: Architecture, config, name: str) -> torch.Tensor | None:
    """The order in which a linear's file rows become the model's (see `_rotary_row_order`), None: as stored."""
    if not arch.rotary_rows_interleaved or not name.endswith(("q_proj", "k_proj")):
        return None
    heads = config.num_attention_heads if name.endswith("q_proj") else config.num_key_value_heads
    return _rotary_row_order(heads * head_dim_of(config), heads)


def _rebuild_meta_buffers(model: nn.Module, config) -> None:
    """Make again, from the config, the parameter-free modules whose buffers were made on meta (rotary tables)."""
    for name, module in list(model.named_modules()):
        meta_buffers = any(b.is_meta for b in module.buffers(recurse=False))
        if name and meta_buffers and next(module.parameters(recurse=False), None) is None:
            model.set_submodule(name, type(module)(config=config))


def _scaled_by_config(config) -> bool:
    """Whether the config scales its rotary itself (Llama 3's `llama3` parameters, which `gguf_config` recovers from
    a file's `rope_freqs`): then the file's frequency factors are already in it and are not applied again."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) != "default"


def _divide_frequencies(model: nn.Module, config, factors: torch.Tensor) -> None:
    """Apply a file's rotary frequency factors (Llama 3.1+'s `rope_freqs`, `[head_dim / 2]`): each inverse frequency
    divided by its factor, as llama.cpp does, unless the config scales its rotary itself (`_scaled_by_config`)."""
    if _scaled_by_config(config):
        return
    rotary = model.model.rotary_emb
    for buffer in ("inv_freq", "original_inv_freq"):
        if hasattr(rotary, buffer):
            setattr(rotary, buffer, getattr(rotary, buffer) / factors.to(getattr(rotary, buffer).dtype))


def describe_packing(model: nn.Module) -> str:
    """Which of the model's linears run on packed kernels and which were unpacked, by kind, in words
    (e.g. `196 on 4-bit kernels, 28 on Q6_K kernels, 1 unpacked to bfloat16`)."""
    from specdraft.models.fast_layers import StackedProjection

    kinds: dict[str, int] = defaultdict(int)
    for name, module in model.named_modules():
        if name.endswith(".halves"):  # counted as its SplitInt4Linear
            continue
        if isinstance(module, StackedProjection):
            for matmul, packed in module.runs:
                split = packed.in_features != module.in_features
                kinds["Q6_K kernels" if matmul is gguf_matmul.block_matmul else
                      f"{packed.type_name} kernels" if matmul is dense_matmul.dense_matmul else
                      f"{packed.type_name} kernels" if matmul in CODE_MATMULS else
                      "4-bit kernels, split in two halves" if split else f"{packed.bits}-bit kernels"] += 1
        elif isinstance(module, SplitInt4Linear):
            kinds["4-bit kernels, split in two halves"] += 1
        elif isinstance(module, Int4Linear):
            kinds[f"{module.tiles.bits if module.tiles is not None else 4}-bit kernels"
                  if module.dense_weight is None else "unpacked"] += 1
        elif isinstance(module, gguf_matmul.BlockLinear):
            kinds["Q6_K kernels"] += 1
        elif isinstance(module, STORED_LINEARS):
            kinds[f"{module.type_name} kernels"] += 1
        elif isinstance(module, FlatLinear):
            kinds[f"unpacked to {str(module.weight.dtype).removeprefix('torch.')}"] += 1
    return ", ".join(f"{count} on {kind}" if "kernels" in kind else f"{count} {kind}"
                     for kind, count in sorted(kinds.items()))


def longrope_refusal(path: Path) -> str:
    """Why a file with LongRoPE factors that the config does not carry is refused, in words."""
    return (f"{path.name} has LongRoPE factors (rope_factors_long / rope_factors_short) that are not as llama.cpp's "
            "converter writes Phi-3.5 and Phi-4-mini (both F32 tensors beside phi3.rope.scaling.original_context_"
            "length), so its rotary cannot be read; its output would be wrong, so it is not loaded.")


def reads_longrope(config) -> bool:
    """Whether the config carries a file's LongRoPE factors (`gguf_config`), so its factor tensors are read."""
    return (getattr(config, "rope_parameters", None) or {}).get("rope_type") == "longrope"


def packed_obstacle(config) -> str | None:
    """Why the packed path cannot build this config's family, or None when it can."""
    if architecture_for(config) is None:
        return (f"packed loading knows the families {', '.join(known_model_types())}, not "
                f"{getattr(config, 'model_type', None)!r}")
    return None


def build_native_model(path: Path, config, dtype: torch.dtype, pack: bool = True, split: bool = True,
                       kept: Path | None = None) -> nn.Module:
    """A model whose weights come straight from the GGUF file's blocks: our own or the family's transformers class
    (see the module's text).

    With `pack=False` every linear is unpacked to `dtype`: the reference the packed model is
    checked against (float32 gives the file's exact values). `split=False`
    unpacks the 5- and 8-bit types instead of splitting them into 4-bit halves, and F16, BF16 and F32 instead of
    keeping them dense: for a draft that `prepare_draft` re-quantizes to plain 4 bits (a half or a quarter of the
    bytes a pass, and a head it can narrow). `kept`: a file
    where the packed modules are kept after a first build and read back on later ones (`packed_store`).
    """
    obstacle = packed_obstacle(config)
    if obstacle is not None:
        raise SpecdraftError(f"Cannot load {path.name} packed: {obstacle}.")
    arch = architecture_for(config)
    grouped: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    frequency_factors = None
    for entry in read_header(path).tensors:
        try:
            place = arch.module_path(entry.name)
        except KeyError:
            if entry.name.split(".")[0] in LONGROPE_FACTORS:
                if reads_longrope(config):
                    continue  # the config holds them
                raise SpecdraftError(longrope_refusal(path)) from None
            raise SpecdraftError(f"Unexpected tensor {entry.name!r} for a {arch.name} model in {path.name}; "
                                 "load it with --gguf-weights unpacked.") from None
        if place is not None:
            grouped[place[0]][place[1]] = entry
        elif entry.name.startswith(FREQUENCY_FACTORS):
            frequency_factors = entry
    if "lm_head" not in grouped:  # tied: the head is built from the embedding's blocks
        grouped["lm_head"] = {"weight": grouped[_EMBEDDING]["weight"]}
    source = _TensorFile(path)
    try:
        built = packed_store.read(kept) if kept is not None else None
        if built is None:
            built = _file_modules(source, grouped, arch, config, dtype, pack, split)
            if pack:
                stack_layers(built, arch, config)
            if kept is not None:  # the embedding is read from the file, not copied into the kept one
                packed_store.keep(kept, {name: m for name, m in built.items() if name != _EMBEDDING})
        else:
            built[_EMBEDDING] = _embedding(source, grouped[_EMBEDDING]["weight"], arch, config, dtype)
        factors = None if frequency_factors is None else source.unpacked(frequency_factors, torch.float32)
    finally:
        source.close()
    if f"model.layers.0.{packed_model.QKV}" in built:
        model = _own_model(built, arch, config, factors)
    else:
        model = _transformers_model(built, config, dtype, factors)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise SpecdraftError(f"The GGUF file {path.name} lacks tensors for {', '.join(missing[:5])}; "
                             "load it with --gguf-weights unpacked.")
    model.config.tie_word_embeddings = False  # head and embedding are separate modules now
    fast_decoder_layers(model)
    return model.eval()


def _transformers_model(built: dict[str, nn.Module | torch.Tensor], config, dtype: torch.dtype,
                        frequency_factors: torch.Tensor | None) -> nn.Module:
    """The family's transformers class, built on the meta device and filled with `built` (emptied here)."""
    from transformers import AutoModelForCausalLM

    config = family_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name in list(built):
        module = built.pop(name)  # held by the model alone from here, so stacking frees it
        if isinstance(module, torch.Tensor):  # a norm's weight
            model.get_submodule(name).weight = nn.Parameter(module, requires_grad=False)
        else:
            model.set_submodule(name, module)
    _rebuild_meta_buffers(model, config)
    if frequency_factors is not None:
        _divide_frequencies(model, config, frequency_factors)
    return model


def family_config(config):
    """`config` as its family's transformers config class (a plain `PretrainedConfig` read from a kept file
    (`loading`) becomes a `LlamaConfig`, ...): what transformers' model classes take."""
    if type(config).model_type:
        return config
    from transformers import AutoConfig

    values = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return AutoConfig.for_model(config.model_type, **values)


_ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}


def _activation_name(config) -> str | None:
    """The MLP's activation as the config names it (Gemma: `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def _own_model_obstacle(config) -> str | None:
    """Why a config's layers cannot run in our own model (`packed_model`), or None."""
    if _activation_name(config) not in _ACTIVATIONS:
        return f"its activation {_activation_name(config)!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    tables = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for table in tables:
        if table.get("rope_type", "default") not in packed_model.STATIC_ROPE_TYPES:
            return f"its rotary ({table.get('rope_type')}) changes with the pass"
        if table.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
            return "its rotary turns part of each head"
    return None


def _layer_parts(built: dict, layer: int, names: tuple[str, ...], fused: str) -> list[str]:
    """The keys in `built` of one layer's projections that read one input: the fused one, else each of `names`."""
    prefix = f"model.layers.{layer}."
    return [prefix + fused] if prefix + fused in built else [prefix + name for name in names]


def stack_layers(built: dict[str, nn.Module | torch.Tensor], arch: Architecture, config) -> bool:
    """Where every layer's q|k|v and gate|up run on tile kernels (and the rest of the model runs in our own model),
    put each layer's stacked projections in `built` in place of the parts (`packed_model.QKV`, `GATE_UP`): what is
    kept then holds them stacked, and a later load maps them in as they run. Returns whether it did."""
    if arch.layer_shape not in LAYER_NORMS or _own_model_obstacle(config) is not None:
        return False
    layers = []
    for layer in range(config.num_hidden_layers):
        qkv = _layer_parts(built, layer, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                           "self_attn.qkv_proj")
        gate_up = _layer_parts(built, layer, ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj")
        if any(name not in built or run_kind(built[name]) is None for name in qkv + gate_up):
            return False
        layers.append((layer, qkv, gate_up))
    for layer, qkv, gate_up in layers:
        for stacked, names in ((packed_model.QKV, qkv), (packed_model.GATE_UP, gate_up)):
            built[f"model.layers.{layer}.{stacked}"] = StackedProjection([built.pop(name) for name in names])
        trim_heap()  # the parts' memory goes back a layer at a time
    return True


def _own_model(built: dict[str, nn.Module | torch.Tensor], arch: Architecture, config,
               frequency_factors: torch.Tensor | None) -> nn.Module:
    """Our own model (`packed_model.PackedForCausalLM`) of `built` (emptied here), its layers stacked already, with a
    copy of `config` of its own (which says it runs our attention)."""
    config = copy.deepcopy(config)
    eps = config.rms_norm_eps

    def norm(name: str) -> packed_model.RMSNorm | None:
        weight = built.pop(name, None)
        return None if weight is None else packed_model.RMSNorm(weight, eps, arch.rms_norm)

    packed_model.use_own_attention(config)
    kinds = getattr(config, "layer_types", None) if arch.rotary_per_layer_type else None
    windows = packed_model.layer_windows(config)
    layers = []
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        parts = packed_model.attention_parts(config, layer, windows[layer], built.pop(prefix + "self_attn.o_proj"),
                                             norm(prefix + "self_attn.q_norm"), norm(prefix + "self_attn.k_norm"))
        attention = StackedAttention(parts, built.pop(prefix + packed_model.QKV))
        mlp = StackedMLP(built.pop(prefix + packed_model.GATE_UP), built.pop(prefix + "mlp.down_proj"),
                         _ACTIVATIONS[_activation_name(config)]())
        norms = {name: norm(prefix + name) for name in filter(None, LAYER_NORMS[arch.layer_shape])}
        layers.append(packed_model.DecoderLayer(arch.layer_shape, norms, attention, mlp,
                                                None if kinds is None else kinds[layer]))
    rotary = packed_model.Rotary(config, arch.rotary_per_layer_type,
                                 None if _scaled_by_config(config) else frequency_factors)
    decoder = packed_model.Decoder(config, built.pop(_EMBEDDING), layers, norm("model.norm"), rotary)
    model = packed_model.PackedForCausalLM(config, decoder, built.pop("lm_head"))
    if built:
        raise SpecdraftError(f"Tensors the model has no place for: {', '.join(list(built)[:5])}.")
    return model


def _embedding(source: _TensorFile, weight: TensorEntry, arch: Architecture, config, dtype: torch.dtype):
    scale = config.hidden_size ** 0.5 if arch.scaled_embedding else None
    return PackedEmbedding(source.table_rows(weight), weight.type_name, weight.shape[1], dtype, scale)


def _file_modules(source: _TensorFile, grouped: dict[str, dict[str, TensorEntry]], arch: Architecture, config,
                  dtype: torch.dtype, pack: bool, split: bool) -> dict[str, nn.Module | torch.Tensor]:
    """Module name -> the module built from its tensors (a norm: its weight, offset as the family declares)."""
    built: dict[str, nn.Module | torch.Tensor] = {}
    for i, (name, entries) in enumerate(grouped.items()):
        weight = entries["weight"]
        if name == _EMBEDDING:
            built[name] = _embedding(source, weight, arch, config, dtype)
        elif name.endswith("norm"):
            built[name] = (source.unpacked(weight, torch.float32) - arch.norm_offset).to(dtype)
        else:
            bias = source.unpacked(entries["bias"], torch.float32) if "bias" in entries else None
            built[name] = _linear(source, weight, bias, dtype, pack, _row_order(arch, config, name), split)
        if i % 8 == 7:  # unpacking temporaries would otherwise pile up as freed but resident pages
            trim_heap()
    return built


_TRANSFORMERS_VIEW = "_specdraft_transformers_view"  # where `transformers_view` keeps what it made, on our model


def transformers_view(model: nn.Module) -> nn.Module:
    """A model for transformers' own `generate` (the `hf-*` bench peers): `model` itself if it is a transformers
    model, else (our own, `packed_model`) the family's transformers class holding the very same parts (embedding,
    stacked layers, norms, rotary tables, head: no tensor copied), made once and kept on `model`."""
    if not isinstance(model, packed_model.PackedForCausalLM):
        return model
    view = model.__dict__.get(_TRANSFORMERS_VIEW)
    if view is None:
        from transformers import AutoModelForCausalLM

        config = family_config(copy.deepcopy(model.config))
        config._attn_implementation = None  # transformers' default; our stacked attention calls its own function
        with torch.device("meta"):
            view = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
        ours, theirs = model.model, view.model
        for mine, layer in zip(ours.layers, theirs.layers):
            for name in [*filter(None, mine.norm_names), "self_attn", "mlp"]:
                setattr(layer, name, getattr(mine, name))
        theirs.embed_tokens, theirs.norm, theirs.rotary_emb = ours.embed_tokens, ours.norm, ours.rotary_emb
        view.lm_head = model.lm_head
        _rebuild_meta_buffers(view, config)
        model.__dict__[_TRANSFORMERS_VIEW] = view.eval()
    return view
