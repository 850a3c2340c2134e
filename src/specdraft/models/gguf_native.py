"""Build a model straight from a GGUF file's blocks, without unpacking it to bf16.

- Q4_K linears run with the file's own scales and mins (`Int4Linear.from_affine`) on our AMX
  kernel (`kernels/amx_tiles.c`) where the CPU grants AMX, else on our AVX-512 kernel
  (`kernels/avx512_tiles.c`), else on PyTorch's CPU int4 kernel: exact up to bf16 rounding of
  each group's scale and offset.
- Q6_K linears keep the file's bits, repacked into tiles (`kernels/gguf_matmul.pack_q6k`), on the
  AVX-512 kernel where it builds and runs; elsewhere they are unpacked.
- Other linears (Q5_0, Q8_0, F16, ...) have no kernel here and are unpacked to the model's
  dtype (a draft's `prepare_draft(..., "int4")` then re-quantizes them: lossy but cheap,
  and it never changes what is emitted).
- The token embedding stays in its file blocks and unpacks only the rows looked up.

The model is built on the meta device and filled tensor by tensor, so memory never holds
an unpacked copy of the whole file. Architectures: those in `TENSOR_NAMES` (Qwen2 family);
others load unpacked through transformers.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.kernels import gguf_matmul
from specdraft.models.fast_layers import fast_decoder_layers
from specdraft.models.gguf_blocks import q4k_affine, unpack_rows
from specdraft.models.heap import trim_heap
from specdraft.models.quantize import Int4Linear, int4_kernel_available

NATIVE_ARCHITECTURES = ("qwen2",)

_LAYER_TENSORS = {  # GGUF name inside blk.N -> module path inside model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROWS_PER_SLICE = 16384  # rows unpacked at a time, so no whole float32 copy of a big matrix exists


def module_path(gguf_name: str) -> tuple[str, str]:
    """`blk.3.attn_q.bias` -> (`model.layers.3.self_attn.q_proj`, `bias`)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}", parts[3]
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[parts[0]], parts[1]
    raise SpecdraftError(f"Unexpected tensor {gguf_name!r} in the GGUF file; load it with --gguf-weights unpacked.")


class PackedEmbedding(nn.Module):
    """An embedding table kept in its GGUF blocks; a lookup unpacks only the rows it needs."""

    def __init__(self, raw: torch.Tensor, type_name: str, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("raw", raw)  # [vocab, bytes per row] uint8
        self.type_name, self.embedding_dim, self.out_dtype = type_name, dim, dtype
        self.num_embeddings = raw.shape[0]

    def num_packed_weights(self) -> int:
        """How many weights the packed table holds."""
        return self.num_embeddings * self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [...] -> [..., dim]
        rows = unpack_rows(self.raw[ids.reshape(-1)], self.type_name, self.embedding_dim)  # [n, dim] float32
        return rows.to(self.out_dtype).view(*ids.shape, self.embedding_dim)


class FlatLinear(nn.Linear):
    """`nn.Linear` that multiplies a 2-D contiguous view: a strided 3-D input (the last
    positions of a pass, sliced for the LM head) otherwise takes a batched path that copies
    the whole weight on every call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        out = super().forward(x.reshape(-1, x.shape[-1]).contiguous())  # [tokens, N]
        return out.view(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a GGUF file: its type, shape (outermost first) and bytes."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


def tensor_index(path: Path, cache: Path | None = None) -> list[TensorEntry]:
    """The file's tensors. Parsing the header with `gguf` takes seconds (its vocabulary is
    metadata), so the index is kept as JSON in `cache` when given."""
    kept = cache / "tensors.json" if cache is not None else None
    if kept is not None and kept.is_file():
        return [TensorEntry(e["name"], e["type_name"], tuple(e["shape"]), e["offset"], e["n_bytes"])
                for e in json.loads(kept.read_text())]
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except ValueError as error:  # gguf maps the file: a cut one fails while shaping its last tensors
        raise SpecdraftError(f"Could not read the GGUF file {path.name} ({error}): it is truncated or corrupt.") from error
    entries = [TensorEntry(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)),
                           int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    if kept is not None:
        try:
            kept.write_text(json.dumps([e.__dict__ for e in entries]))
        except OSError:
            pass  # only costs the parse next time
    return entries


class _TensorFile:
    """Reads tensors' bytes with plain reads (no memory map, so nothing of the file stays resident)."""

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


def _linear(source: _TensorFile, weight: TensorEntry, bias: torch.Tensor | None, dtype: torch.dtype,
            pack: bool) -> nn.Module:
    """The module for one GGUF linear: packed for Q4_K and Q6_K (where their kernels run), else unpacked."""
    out_features, in_features = weight.shape
    if pack and weight.type_name == "Q4_K" and out_features % 16 == 0 and int4_kernel_available():
        codes, scale, minimum = q4k_affine(source.rows(weight))
        return Int4Linear.from_affine(codes, scale, minimum, bias)
    if pack and weight.type_name in gguf_matmul.BLOCK_BYTES and gguf_matmul.available():
        return gguf_matmul.BlockLinear(source.lazy_rows(weight), weight.type_name, in_features, bias)
    with torch.device("meta"):
        linear = FlatLinear(in_features, out_features, bias=bias is not None)
    linear.weight = nn.Parameter(source.unpacked(weight, dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return linear


def build_native_model(path: Path, config, dtype: torch.dtype, pack: bool = True,
                       cache: Path | None = None) -> nn.Module:
    """A transformers model whose weights come straight from the GGUF file's blocks (see module doc).

    With `pack=False` every linear is unpacked to `dtype`: the reference the packed model is
    checked against (float32 gives the file's exact values). `cache` keeps the tensor index.
    """
    from transformers import AutoModelForCausalLM

    if config.model_type not in NATIVE_ARCHITECTURES:
        raise SpecdraftError(f"Packed GGUF loading supports {', '.join(NATIVE_ARCHITECTURES)}, not {config.model_type!r}.")
    grouped: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    for entry in tensor_index(path, cache):
        module, param = module_path(entry.name)
        grouped[module][param] = entry
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if "lm_head" not in grouped:  # tied: the head is built from the embedding's blocks
        grouped["lm_head"] = {"weight": grouped["model.embed_tokens"]["weight"]}
    source = _TensorFile(path)
    try:
        for i, (name, entries) in enumerate(grouped.items()):
            weight = entries["weight"]
            if name == "model.embed_tokens":
                module = PackedEmbedding(source.rows(weight), weight.type_name, weight.shape[1], dtype)
            elif name.endswith("norm"):
                module = model.get_submodule(name)
                module.weight = nn.Parameter(source.unpacked(weight, dtype), requires_grad=False)
            else:
                bias = source.unpacked(entries["bias"], torch.float32) if "bias" in entries else None
                module = _linear(source, weight, bias, dtype, pack)
            model.set_submodule(name, module)
            if i % 8 == 7:  # unpacking temporaries would otherwise pile up as freed but resident pages
                trim_heap()
    finally:
        source.close()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were made on meta
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise SpecdraftError(f"The GGUF file {path.name} lacks tensors for {', '.join(missing[:5])}; "
                             "load it with --gguf-weights unpacked.")
    model.config.tie_word_embeddings = False  # head and embedding are separate modules now
    fast_decoder_layers(model)
    return model.eval()
