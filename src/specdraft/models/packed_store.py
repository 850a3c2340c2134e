"""A GGUF file's packed modules kept on disk after the first load, so later loads map them back in a second
instead of converting the file's blocks again.

What is kept is the loader's own modules (packed linears, their layers' q|k|v and gate|up stacked where the model
runs in our own class (`packed_model`), norm weights), not the model: a transformers model unpickled whole lost its
hidden-state capture. A kept
file is named by what decides its bytes: the tile kernel (its layout), the dtype, whether 5- and 8-bit linears are
split, and a digest of the packing code and PyTorch's version, so a change to any of them packs again. The
file's own identity (path, size, modification time) names the folder (`loading._converted_dir`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from specdraft.kernels import tiles
from specdraft.models.heap import drops_file_pages
from specdraft.paths import partial_path

_PACKING_CODE = ("models/gguf_native.py", "models/gguf_blocks.py", "models/quantize.py", "models/architectures.py",
                 "models/fast_layers.py", "models/packed_model.py",
                 "kernels/int4_layout.py", "kernels/gguf_matmul.py", "kernels/dense_matmul.py", "kernels/int8_codes.py",
                 "kernels/q4k_tiles.py", "kernels/tile_linear.py", "kernels/tiles.py", "gguf_layout.py")  # what decides the bytes


@lru_cache(maxsize=1)
def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(torch.__version__.encode())
    for name in _PACKING_CODE:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:12]


def kept_file(folder: Path, dtype: torch.dtype, split: bool) -> Path | None:
    """Where a model packed with these choices is kept in `folder`; None where no tile kernel runs (the PyTorch
    level's int4 packing is PyTorch's own and cheap to redo)."""
    kernel = tiles.tile_kernel()
    if kernel is None:
        return None
    variant = f"{tiles.kernel_name(kernel)}-{str(dtype).removeprefix('torch.')}-{'split' if split else 'plain'}"
    return folder / f"{variant}-{_code_digest()}.pt"


def read(file: Path) -> dict[str, nn.Module | torch.Tensor] | None:
    """The kept modules (name -> module, or a norm's weight), or None when there are none or they cannot be read."""
    if not file.is_file():
        return None
    try:
        # our own cache file (written by `keep`), holding our module classes: not a weights-only pickle. Mapped where
        # the stacking can give back what it replaces (`heap.drops_file_pages`): pages come in as passes touch them
        return torch.load(file, weights_only=False, mmap=drops_file_pages())
    except Exception as error:  # a cut or stale file costs one conversion, never the load
        print(f"warning: could not read the kept packed model {file} ({error}); packing again", file=sys.stderr)
        return None


def keep(file: Path, built: dict[str, nn.Module | torch.Tensor]) -> None:
    """Save `built` to `file` atomically, removing the same variant kept by older packing code; a failure (a full
    disk, a read-only cache) only costs the conversion next time."""
    partial = partial_path(file)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(built, partial)
        os.replace(partial, file)
        print(f"kept the packed model in {file} ({file.stat().st_size / 1e9:.1f} GB): later loads read it back",
              file=sys.stderr)
        variant = file.name.rsplit("-", 1)[0]
        for old in file.parent.glob(f"{variant}-*.pt"):
            if old != file:
                old.unlink(missing_ok=True)
    except OSError as error:
        partial.unlink(missing_ok=True)
        print(f"warning: could not keep the packed model in {file.parent}: {error}", file=sys.stderr)
