"""The numeric choices of the CPU path in one place: which instruction set the native kernels use, which dot product
the AVX-512 tiles are built on, whether the AVX2 int8 products run on AVX-VNNI, which passes multiply int8
activations, whether bf16 linears run prepacked, and whether a model runs on a static cache.

Each has a `SPECDRAFT_*` variable (read here and nowhere else) and a default for this CPU. `current()` resolves them
into a `NumericConfig`: `CausalLM` takes one when it loads (`CausalLM.numerics`), the loading line names it, and
the kernel modules ask it which native library runs (`NumericConfig.library`). A bad value fails once, at load,
with a message that says what to set.

- `SPECDRAFT_ISA` (torch, avx2, avx512, amx): the highest level the kernels may use; unset, the best this CPU has
  (`isa.detected`). Forcing a lower level on a bigger CPU (`avx2` on an AVX-512 machine) runs and tests that
  level's kernels there.
- `SPECDRAFT_TILE_DOTS` (int16, bf16): the AVX-512 tiles' dot product; unset, bf16 on AMD CPUs with AVX-512 BF16
  (both instructions issue alike there, and bf16 needs a third of int16's float work per group), else int16 (on
  Intel `vdpbf16ps` is the slower one: 43 against 62 G multiply-adds/s a core).
- `SPECDRAFT_AVX_VNNI` (0, 1): the AVX2 library's int8 products on AVX-VNNI's 256-bit `vpdpbusd` (the same bits as
  `vpmaddubsw` + `vpaddw`, fewer instructions); unset, where the CPU has it. 0 runs a Zen 3's build on a CPU with it.
- `SPECDRAFT_INT8_ACTIVATIONS` (every, prompt, none): which passes multiply int8 activations (`prompt_pass`);
  unset, `every` where the AVX2 or AVX-512 tiles run and `prompt` where AMX runs.
- `SPECDRAFT_PREPACK` (0, 1): bf16 linears of an unpacked model on oneDNN's prepacked weights (`models/prepacked`).
- `SPECDRAFT_STATIC_CACHE` (0, 1, auto): a static cache and CUDA graphs (`CausalLM`; auto: on CUDA).
- `SPECDRAFT_FUSED_KERNELS` (0, 1, auto): the GPU's Triton kernels in a static pass (`models/fused_kernels`; auto: on
  CUDA; 1 also on the CPU under Triton's interpreter).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace
from functools import lru_cache

from specdraft.errors import SpecdraftError
from specdraft.kernels import bindings, isa

ISA_VARIABLE = "SPECDRAFT_ISA"
TILE_DOTS_VARIABLE = "SPECDRAFT_TILE_DOTS"
AVX_VNNI_VARIABLE = "SPECDRAFT_AVX_VNNI"
INT8_VARIABLE = "SPECDRAFT_INT8_ACTIVATIONS"
PREPACK_VARIABLE = "SPECDRAFT_PREPACK"
STATIC_CACHE_VARIABLE = "SPECDRAFT_STATIC_CACHE"
FUSED_KERNELS_VARIABLE = "SPECDRAFT_FUSED_KERNELS"
DOTS = ("int16", "bf16")
INT8_MODES = ("every", "prompt", "none")
SWITCH_MODES = ("0", "1", "auto")


@dataclass(frozen=True)
class NumericConfig:
    """The numeric choices a model runs with (see the module's docstring for each)."""

    isa: str  # torch | avx2 | avx512 | amx: the highest level the native kernels may use
    tile_dots: str  # int16 | bf16: the AVX-512 tiles' dot product
    avx_vnni: bool  # the AVX2 library built with AVX-VNNI
    int8_activations: str | None  # every | prompt | none, or None: the default of the tile kernel that runs
    prepack: bool = True
    static_cache: str = "auto"
    fused_kernels: str = "auto"
    forced_isa: bool = False  # `isa` came from SPECDRAFT_ISA

    def allows(self, level: str) -> bool:
        """Whether kernels of `level` may run: it is at or below `isa`."""
        return isa.LEVELS.index(level) <= isa.LEVELS.index(self.isa)

    def library(self, level: str | None = None) -> ctypes.CDLL | None:
        """The native library the kernels of `level` (default: the best allowed) run in, built on first use, or None
        where it cannot build or run here: `amx` and `avx512` the AVX-512 library (built with AMX where allowed and
        granted), `avx2` the AVX2 one (with AVX-VNNI where `avx_vnni`)."""
        return _library(self, level)

    def with_isa(self, level: str) -> "NumericConfig":
        """This configuration with the kernels held to `level` (which must be at or below this CPU's)."""
        return replace(self, isa=_checked_level(level), forced_isa=True)


@lru_cache(maxsize=None)
def _library(config: NumericConfig, level: str | None) -> ctypes.CDLL | None:
    if level is None:
        return next((library for chosen in ("amx", "avx512", "avx2")
                     if config.allows(chosen) and (library := _library(config, chosen)) is not None), None)
    if not config.allows(level) or level == "torch":
        return None
    if level == "avx2":
        return (config.avx_vnni and bindings.library(bindings.Build("avx2", avx_vnni=True))) or bindings.library(
            bindings.Build("avx2"))
    with_amx = bindings.library(bindings.Build("avx512", config.tile_dots, amx=True)) if config.allows("amx") else None
    if level == "amx" or with_amx is not None:
        return with_amx
    return bindings.library(bindings.Build("avx512", config.tile_dots))


def _checked_level(chosen: str) -> str:
    if chosen not in isa.LEVELS:
        raise SpecdraftError(f"{ISA_VARIABLE} must be one of {', '.join(isa.LEVELS)} (or unset to use the best this CPU "
                             f"has), got {chosen!r}.")
    missing = isa.CPU_FLAGS[chosen] - isa.cpu_flags()
    if missing:
        raise SpecdraftError(f"{ISA_VARIABLE}={chosen} needs CPU flags this machine lacks ({', '.join(sorted(missing))}); "
                             f"this CPU runs up to {isa.detected()}: set {ISA_VARIABLE} to that or lower, or unset it.")
    return chosen


def _setting(variable: str) -> str:
    return os.environ.get(variable, "").strip().lower()


def _switch(variable: str) -> bool | None:
    """A 0/1 variable: False, True, or None where unset."""
    setting = _setting(variable)
    if setting not in ("", "0", "1"):
        raise SpecdraftError(f"{variable} must be 0 or 1 (or unset for this machine's default), got {setting!r}.")
    return None if not setting else setting == "1"


def _avx_vnni() -> bool:
    wanted, has = _switch(AVX_VNNI_VARIABLE), isa.AVX_VNNI_CPU_FLAGS <= isa.cpu_flags()
    if wanted and not has:
        raise SpecdraftError(f"{AVX_VNNI_VARIABLE}=1 needs the CPU flag avx_vnni, which this machine lacks; set it to 0 "
                             "or unset it.")
    return has and wanted is not False


def _choice(variable: str, choices: tuple[str, ...]) -> str | None:
    setting = _setting(variable)
    if setting and setting not in choices:
        raise SpecdraftError(f"{variable} must be one of {', '.join(choices)} (or unset for this machine's default), "
                             f"got {setting!r}.")
    return setting or None


_VARIABLES = (ISA_VARIABLE, TILE_DOTS_VARIABLE, AVX_VNNI_VARIABLE, INT8_VARIABLE, PREPACK_VARIABLE, STATIC_CACHE_VARIABLE,
              FUSED_KERNELS_VARIABLE)


def current() -> NumericConfig:
    """The configuration the `SPECDRAFT_*` variables ask for now, each unset one at this CPU's default (resolved once
    for each set of values: the kernels ask on every call)."""
    return _resolved(tuple(os.environ.get(variable) for variable in _VARIABLES))


@lru_cache(maxsize=64)
def _resolved(values: tuple[str | None, ...]) -> NumericConfig:
    forced = _setting(ISA_VARIABLE)
    return NumericConfig(
        isa=_checked_level(forced) if forced else isa.detected(),
        tile_dots=_choice(TILE_DOTS_VARIABLE, DOTS) or isa.preferred_tile_dots(),
        avx_vnni=_avx_vnni(),
        int8_activations=_choice(INT8_VARIABLE, INT8_MODES),
        prepack=_switch(PREPACK_VARIABLE) is not False,
        static_cache=_choice(STATIC_CACHE_VARIABLE, SWITCH_MODES) or "auto",
        fused_kernels=_choice(FUSED_KERNELS_VARIABLE, SWITCH_MODES) or "auto",
        forced_isa=bool(forced),
    )
