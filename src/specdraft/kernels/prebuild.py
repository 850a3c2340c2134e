"""Build every native kernel this CPU runs ahead of use, so no compile lands inside a (timed) generation.

Each kernel module's `available()` compiles its C file the first time (kernels/build.py keeps the result in
the cache folder, so later calls only load it) and says whether it runs here as `SPECDRAFT_ISA` allows.
`build_all()` calls it on every kernel module: `specdraft kernels` (which `make setup` runs after installing)
shows the result, and `specdraft generate`, `serve`, `costs` and `bench` call it before they load a model.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType

import specdraft.kernels as package
from specdraft.kernels import isa

# Modules of this package whose `available()` only asks another kernel module (nothing of their own to build).
NOT_KERNELS = frozenset({"gguf_matmul", "prebuild"})


def kernel_names() -> list[str]:
    """The kernel modules, found rather than listed (kernels are added and renamed): every module of
    `specdraft.kernels` with a module-level `available()`, but NOT_KERNELS (amx_tiles, avx512_tiles,
    avx2_tiles, vnni_tiles, layer_ops, the decoder layers, the attention kernel, any `*_avx2` module)."""
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__) if info.name not in NOT_KERNELS)
    return [name for name in names if callable(getattr(_module(name), "available", None))]


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{package.__name__}.{name}")


def build_all() -> dict[str, bool]:
    """{kernel module: whether it runs here}, each one built first where this CPU (and `SPECDRAFT_ISA`) lets it run."""
    isa.isa()  # a bad SPECDRAFT_ISA fails here, once, before any module is asked
    return {name: bool(_module(name).available()) for name in kernel_names()}


def in_use() -> dict:
    """The level the kernels run at (`isa.isa()`), the tile kernel that multiplies 4-bit and Q6_K weights (`torch`
    where none runs), which passes multiply int8 activations (`every`, `prompt` or `none`: `prompt_pass`), whether
    the AVX2 tiles' int8 products run on AVX-VNNI (`isa.avx_vnni`), and `SPECDRAFT_ISA` (None where unset)."""
    from specdraft.kernels import prompt_pass
    from specdraft.kernels.tiles import int8_every_pass, kernel_name, tile_kernel

    tiles = kernel_name(tile_kernel())
    int8 = "none" if tiles == "torch" or not prompt_pass.enabled() else "every" if int8_every_pass() else "prompt"
    return {"isa": isa.isa(), "tiles": tiles, "int8_activations": int8,
            "avx_vnni": tiles == "avx2" and int8 != "none" and isa.avx_vnni(),
            isa.VARIABLE: os.environ.get(isa.VARIABLE) or None}


def in_use_text(kernels: dict | None = None) -> str:
    """One line naming the kernels in use (an `in_use()` dict, default this process's)."""
    kernels = in_use() if kernels is None else kernels
    forced = kernels.get(isa.VARIABLE)
    note = (f"forced by {isa.VARIABLE}={forced}" if forced
            else f"{isa.VARIABLE}={'|'.join(isa.LEVELS)} forces a level")
    int8 = {"every": ", int8 activations on every pass", "prompt": ", int8 activations on prompt passes"}.get(
        kernels.get("int8_activations") or "", "") + (" (AVX-VNNI)" if kernels.get("avx_vnni") else "")
    return f"kernels: {kernels['isa']} level, {kernels['tiles']} tiles{int8} ({note})"
