"""How often each token of a vocabulary occurs in a text corpus: what `draft_head` ranks a draft's
partial LM head by (`--draft-vocab`).

Counts belong to a tokenizer, not to a model: a file records its tokenizer's fingerprint (a hash
of every token string by id) and applies only where that matches. A draft takes the counts made
for its tokenizer (`token_counts_for`): first those `specdraft train vocab` made (kept in the
cache folder, `<cache>/vocab/`), then those shipped in `models/vocab/` (the bundled models'
tokenizer, counted over Python's standard library and this machine's documentation).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdraft.errors import SpecdraftError
from specdraft.paths import cache_dir, partial_path

SHIPPED = Path(__file__).parent / "vocab"
SUFFIX = ".token_counts.safetensors"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (every token string with its id)."""
    ordered = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256("\n".join(f"{index}\t{token}" for token, index in ordered).encode()).hexdigest()[:16]


def save_token_counts(path: Path, counts: torch.Tensor, tokenizer, about: dict) -> None:
    """Write `counts` [vocab] with the tokenizer's fingerprint and `about` (what was counted) as metadata."""
    if counts.max() >= 2**31:
        raise SpecdraftError("Counts past 2^31 do not fit the file's int32; count fewer tokens.")
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"fingerprint": tokenizer_fingerprint(tokenizer), "about": json.dumps(about)}
    partial = partial_path(path)
    try:
        save_file({"counts": counts.to(torch.int32).contiguous()}, str(partial), metadata=metadata)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _read(path: Path) -> tuple[str | None, torch.Tensor]:
    """(fingerprint, counts as int64 [vocab]) of a counts file."""
    with safe_open(str(path), "pt") as kept:
        return (kept.metadata() or {}).get("fingerprint"), kept.get_tensor("counts").long()


def load_token_counts(path: Path, tokenizer=None) -> torch.Tensor:
    """The counts in `path` as int64 [vocab]; with `tokenizer`, refused unless they were made for it."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"No token counts file at {path}; make one with `specdraft train vocab`.")
    fingerprint, counts = _read(path)
    if tokenizer is not None and fingerprint != tokenizer_fingerprint(tokenizer):
        raise SpecdraftError(f"The token counts in {path} were made for another tokenizer; make them for this "
                             "model's with `specdraft train vocab`.")
    return counts


def _made_path(fingerprint: str) -> Path:

    return cache_dir() / "vocab" / f"{fingerprint}{SUFFIX}"


def made_counts_path(tokenizer) -> Path:
    """Where `specdraft train vocab` keeps counts for `tokenizer` by default (found by `token_counts_for`)."""
    return _made_path(tokenizer_fingerprint(tokenizer))


def token_counts_for(tokenizer) -> tuple[torch.Tensor, Path] | None:
    """(counts, their file) made for `tokenizer`: made here first, else shipped; None when there are none."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    for path in [_made_path(fingerprint), *sorted(SHIPPED.glob(f"*{SUFFIX}"))]:
        if path.is_file():
            found, counts = _read(path)
            if found == fingerprint:
                return counts, path
    return None
