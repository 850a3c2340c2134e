"""A GGUF file's header, read in one pass: its metadata (keys, values and their GGUF value types) and its
tensor table (name, block type, shape, where the bytes lie).

gguf-py's `GGUFReader` maps every metadata value as its own numpy view: 9-25 s over a 128k-token vocabulary
and its merges on 2 cores, paid by transformers' GGUF config parser as well. This reader walks the same bytes
with `struct` and keeps string arrays (vocabularies, merges) only when asked: well under a second.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from specdraft.errors import SpecdraftError

SCALAR_FORMATS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                  GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                  GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                  GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, where general.alignment is absent


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a GGUF file: its type, shape (outermost first) and bytes (`offset` from the
    file's start)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GgufField:
    """One metadata value and its GGUF type (`item_kind`: an array's element type, else None). A string array
    not asked for holds its length in place of its strings."""

    value: Any
    kind: GGUFValueType
    item_kind: GGUFValueType | None = None


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata fields and tensor table."""

    fields: dict[str, GgufField]
    tensors: list[TensorEntry]

    def get(self, key: str, default: Any = None) -> Any:
        """The value under `key`, or `default`."""
        field = self.fields.get(key)
        return default if field is None else field.value

    @property
    def architecture(self) -> str:
        """`general.architecture` (e.g. `llama`, `qwen3`, `gemma3`)."""
        return self.get("general.architecture")


class _Cursor:
    """Reads little-endian GGUF values from a buffer, moving forward."""

    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        self.at += length
        return bytes(self.data[self.at - length:self.at]).decode("utf-8")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self.data, self.at)
            self.at += 8 + length

    def field(self, keep_strings: bool) -> GgufField:
        (kind,) = self.unpack("I")
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return GgufField(self.string(), kind)
        if kind != GGUFValueType.ARRAY:
            return GgufField(self.unpack(SCALAR_FORMATS[kind])[0], kind)
        item, count = self.unpack("IQ")
        item = GGUFValueType(item)
        if item in SCALAR_FORMATS:  # numbers in one read
            dtype = np.dtype("<" + SCALAR_FORMATS[item])
            values = np.frombuffer(self.data, dtype, count, self.at).tolist()
            self.at += dtype.itemsize * count
        elif item != GGUFValueType.STRING:
            raise SpecdraftError(f"GGUF metadata holds an array of {item.name} values, which this reader cannot read.")
        elif keep_strings:
            values = [self.string() for _ in range(count)]
        else:
            self.skip_strings(count)
            values = count
        return GgufField(values, kind, item)


def read_header(path: str | Path, string_arrays: bool | str = False) -> GgufHeader:
    """The header of the GGUF file at `path`. String arrays are kept whole when `string_arrays` is True, or
    for keys starting with it when it is a prefix (e.g. `"tokenizer."`); others hold their lengths."""
    path = Path(path)
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data, string_arrays)
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as error:
        raise SpecdraftError(f"Could not read the GGUF file {path.name} ({error}): it is truncated or corrupt.") from error


def _parse(data, string_arrays: bool | str) -> GgufHeader:
    if data[:4] != b"GGUF":
        raise SpecdraftError("not a GGUF file (it does not start with the GGUF magic bytes)")
    cursor = _Cursor(data)
    cursor.at = 4
    version, n_tensors, n_fields = cursor.unpack("IQQ")
    if version < 2:
        raise SpecdraftError(f"GGUF version {version} is too old; convert the model again with a recent llama.cpp.")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        keep = string_arrays if isinstance(string_arrays, bool) else key.startswith(string_arrays)
        fields[key] = cursor.field(keep)
    table = []
    for _ in range(n_tensors):
        name = cursor.string()
        (n_dims,) = cursor.unpack("I")
        dims = cursor.unpack(f"{n_dims}Q")  # innermost first
        type_id, offset = cursor.unpack("IQ")
        table.append((name, GGMLQuantizationType(type_id), tuple(int(d) for d in reversed(dims)), offset))
    alignment = fields.get("general.alignment", GgufField(_DEFAULT_ALIGNMENT, GGUFValueType.UINT32)).value
    data_start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, kind, shape, offset in table:
        block_size, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape)) // block_size * block_bytes
        tensors.append(TensorEntry(name, kind.name, shape, data_start + offset, n_bytes))
    return GgufHeader(fields, tensors)
