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
