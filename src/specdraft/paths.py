"""Where specdraft keeps what it makes once: assembled model files, converted models, built kernels, token counts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder: `SPECDRAFT_CACHE`, else `$XDG_CACHE_HOME/specdraft`, else `~/.cache/specdraft`."""
    if os.environ.get("SPECDRAFT_CACHE"):
        return Path(os.environ["SPECDRAFT_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "specdraft"


def partial_path(path: Path) -> Path:
    """Where this process writes `path` before moving it into place (`os.replace`): a name of its own, so two
    processes that keep the same file or folder at once never write into each other's."""
    return path.with_name(f"{path.name}.{os.getpid()}.partial")
