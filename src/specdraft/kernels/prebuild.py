"""Build every native library this CPU runs ahead of use, so no compile lands inside a (timed) generation.

`NumericConfig.library` compiles a library the first time it is asked for (kernels/build.py keeps the result in the
cache folder, so later calls only load it). `build_all()` asks for each level this CPU and the configuration allow:
`specdraft kernels` (which `make setup` runs after installing) shows the result, and `specdraft generate`, `serve`,
`costs` and `bench` call it before they load a model.
"""

from __future__ import annotations

from specdraft.kernels import numerics
from specdraft.kernels.numerics import NumericConfig

LIBRARY_LEVELS = ("avx2", "avx512", "amx")  # `amx`: the AVX-512 library built with AMX


def build_all(config: NumericConfig | None = None) -> dict[str, bool]:
    """{level: whether its library runs here}, each one built first where this CPU and `config` (default: the
    `SPECDRAFT_*` variables now; a bad one fails here, once) let it run."""
    config = config or numerics.current()
    return {level: config.library(level) is not None for level in LIBRARY_LEVELS}


def in_use(config: NumericConfig | None = None) -> dict:
    """The level the kernels run at, the tile kernel that multiplies 4-bit and Q6_K weights (`torch` where none runs),
    the AVX-512 tiles' dot product, which passes multiply int8 activations (`every`, `prompt` or `none`:
    `prompt_pass`), whether the AVX2 tiles' int8 products run on AVX-VNNI, and `SPECDRAFT_ISA` (None where unset)."""
    from specdraft.kernels.tiles import int8_every_pass, kernel_name, tile_kernel

    config = config or numerics.current()
    tiles = kernel_name(tile_kernel(config))
    int8 = ("none" if tiles == "torch" or config.int8_activations == "none"
            else "every" if int8_every_pass(config) else "prompt")
    return {"isa": config.isa, "tiles": tiles, "tile_dots": config.tile_dots if tiles in ("avx512", "amx") else None,
            "int8_activations": int8, "avx_vnni": tiles == "avx2" and int8 != "none" and config.avx_vnni,
            numerics.ISA_VARIABLE: config.isa if config.forced_isa else None}


def in_use_text(kernels: dict | None = None) -> str:
    """One line naming the kernels in use (an `in_use()` dict, default this process's)."""
    kernels = in_use() if kernels is None else kernels
    variable = numerics.ISA_VARIABLE
    forced = kernels.get(variable)
    note = f"forced by {variable}={forced}" if forced else f"{variable}={'|'.join(('torch', *LIBRARY_LEVELS))} forces a level"
    dots = f" ({kernels['tile_dots']} dots)" if kernels.get("tile_dots") else ""
    int8 = {"every": ", int8 activations on every pass", "prompt": ", int8 activations on prompt passes"}.get(
        kernels.get("int8_activations") or "", "") + (" (AVX-VNNI)" if kernels.get("avx_vnni") else "")
    return f"kernels: {kernels['isa']} level, {kernels['tiles']} tiles{dots}{int8} ({note})"
