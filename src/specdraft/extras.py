"""The optional parts of specdraft and the extra that installs each (`pip install 'specdraft[EXTRA]'`).

The core (`pip install specdraft`) is the library and the command line's `generate`, `check`, `costs`,
`theory`, `models`, `drafters`, `kernels` and `train`; the rest is opt-in:

    server    fastapi, uvicorn, pydantic    `specdraft serve`, `specdraft.server`
    bench     matplotlib                    `specdraft bench`, the charts of `theory --out` and `diagnose --out`
    loadtest  bench's, and openai           `specdraft loadtest`
    ray       server's, and ray[serve]      `specdraft serve --ray`
    models    the bundled pair's packages   the default target and draft

`require` turns a missing one into a one-line `MissingExtra` naming the extra, before any work starts.
"""

from __future__ import annotations

import importlib.util

from specdraft.errors import SpecdraftError


class MissingExtra(SpecdraftError, ImportError):
    """An optional dependency is not installed: a user's mistake (one line, exit 2) and an ImportError alike."""


def missing(*modules: str) -> list[str]:
    """Those of `modules` (top-level import names) that cannot be imported here."""
    return [module for module in modules if importlib.util.find_spec(module) is None]


def require(extra: str, feature: str, *modules: str) -> None:
    """Raise `MissingExtra` if any of `modules` is not installed: `feature` (what the user asked for) needs the
    extra `extra`."""
    absent = missing(*modules)
    if absent:
        names = " and ".join(absent)
        raise MissingExtra(f"{feature} needs {names}, not installed here: pip install 'specdraft[{extra}]' "
                           f"(from a checkout: pip install -e '.[{extra}]').")
