"""Which dot product the AVX-512 tile kernels (`avx512_tiles.c`) are built on: `int16` (`vpdpwssd`) or `bf16`
(`vdpbf16ps`). Every build that includes that file (the tile kernels, the prompt kernels, the fused decoder)
takes the same one, so a model's passes compute one function whichever path runs them.
"""

from __future__ import annotations

import os
from functools import lru_cache

from specdraft.errors import SpecdraftError
from specdraft.kernels.build import cpu_flags, cpu_vendor

DOTS = ("int16", "bf16")
VARIABLE = "SPECDRAFT_TILE_DOTS"
_OPTIONS = {"int16": ([], set()), "bf16": (["-DTILE_DOTS_BF16", "-mavx512bf16"], {"avx512_bf16"})}


def dots() -> str:
    """`$SPECDRAFT_TILE_DOTS` when set (int16 or bf16), else bf16 on AMD CPUs with AVX-512 BF16 (both
    instructions issue alike there, and bf16 needs a third of int16's float work per group), else int16
    (on Intel `vdpbf16ps` is the slower instruction; CPUs without AVX-512 BF16 have only this one)."""
    chosen = os.environ.get(VARIABLE, "").strip().lower()
    if chosen:
        if chosen not in DOTS:
            raise SpecdraftError(f"{VARIABLE} must be one of {', '.join(DOTS)} (or unset to choose by CPU), got {chosen!r}.")
        return chosen
    return _for_this_cpu()


@lru_cache(maxsize=1)
def _for_this_cpu() -> str:
    return "bf16" if cpu_vendor() == "AuthenticAMD" and "avx512_bf16" in cpu_flags() else "int16"


def build_options(flavour: str | None = None) -> tuple[list[str], set[str]]:
    """Compiler flags and the CPU flags they require, added to a build that includes `avx512_tiles.c`, for the tile
    kernels of `flavour` (default: `dots()`)."""
    flags, required = _OPTIONS[flavour or dots()]
    return list(flags), set(required)
