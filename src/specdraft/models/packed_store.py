"""A packed GGUF model kept on disk after its first load, so later loads map it instead of repacking the file.

Packing (the file's blocks rearranged into the kernels' tiles, projections stacked) costs most of a first
load: 40 s for a 1B model on 2 cores. The built model is saved once with `torch.save` (its tensors are the
packed tiles, scales and the embedding's raw blocks) and later loads read it back memory-mapped
(`torch.load(mmap=True)`): a fraction of a second, pages read from the disk cache as the kernels touch them.

A kept model is only valid for what chose its layout, so it is filed under a key of: the model's dtype and
whether 5- and 8-bit types were split (`gguf_native.build_native_model(split=)`), the tile kernel and native
layer operations that run here, the versions of torch and transformers, and a digest of this package's model
and kernel sources. Anything else (another kernel level forced by `SPECDRAFT_ISA`, new code) is a new key; an
unreadable kept file is built again.
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

_FILE = "model.pt"


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """A digest of the sources that decide how a model is packed (models/ and kernels/)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("models", "kernels"):
        for path in sorted((root / folder).glob("*")):
            if path.suffix in (".py", ".c", ".h"):
                digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def store_key(dtype: torch.dtype, split: bool) -> str:
    """The key a packed model is kept under here (see the module's text)."""
    import transformers

    from specdraft.kernels import decoder_layers, layer_ops, tiles

    parts = (str(dtype), f"split={split}", tiles.kernel_name(tiles.tile_kernel()), f"ops={layer_ops.available()}",
             f"silu={decoder_layers.same_silu_as_torch()}", torch.__version__, transformers.__version__,
             _source_digest())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def kept_model(folder: Path) -> nn.Module | None:
    """The model kept in `folder`, memory-mapped, or None where there is none (or it cannot be read)."""
    path = folder / _FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, mmap=True, weights_only=False)  # our own file, written by `keep_model`
    except Exception as error:  # a cut or stale file is rebuilt, never fatal
        print(f"warning: could not read the kept packed model {path} ({error}); packing the file again",
              file=sys.stderr)
        return None


def keep_model(model: nn.Module, folder: Path) -> None:
    """Save a freshly built packed model in `folder` (written to a temporary name, then renamed)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{_FILE}.{os.getpid()}.partial"
        torch.save(model, partial)
        partial.replace(folder / _FILE)
    except OSError as error:  # only costs the packing next time
        print(f"warning: could not keep the packed model in {folder}: {error}", file=sys.stderr)
