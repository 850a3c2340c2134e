"""Which instruction sets the native kernels may use: the best this CPU has, or the one `SPECDRAFT_ISA` forces.

The levels build on each other: `torch` (no native kernel: PyTorch's own), `avx2` (AVX2 + FMA + F16C:
`avx2_tiles`), `avx512` (AVX-512 with VNNI: `avx512_tiles`, the fused decoder, the layer and attention
kernels, the int8 prompt kernels), `amx` (AVX-512 plus AMX tiles where the OS grants them: `amx_tiles`).
A kernel of one level runs where `allows(level)` holds and the CPU has its flags, so forcing a lower level
on a bigger CPU (`SPECDRAFT_ISA=avx2` on an AVX-512 machine) runs and tests that level's kernels there.
"""

from __future__ import annotations

import os
from functools import lru_cache

from specdraft.errors import SpecdraftError
from specdraft.kernels.build import cpu_flags

LEVELS = ("torch", "avx2", "avx512", "amx")  # each level's kernels add to those below it
VARIABLE = "SPECDRAFT_ISA"
AVX_VNNI_VARIABLE = "SPECDRAFT_AVX_VNNI"
AVX_VNNI_BUILD = (["-mavxvnni"], {"avx_vnni"})  # what the AVX2 builds add for AVX-VNNI: compiler and CPU flags
CPU_FLAGS = {  # what a level needs of /proc/cpuinfo's flags
    "torch": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma"},
    "amx": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"},
}


@lru_cache(maxsize=1)
def detected() -> str:
    """The highest level whose CPU flags this machine has (whether the OS grants AMX is `amx_tiles`'s question)."""
    flags = cpu_flags()
    return next(level for level in reversed(LEVELS) if CPU_FLAGS[level] <= flags)


def isa() -> str:
    """`$SPECDRAFT_ISA` when set (torch, avx2, avx512 or amx; the CPU must have it), else `detected()`."""
    chosen = os.environ.get(VARIABLE, "").strip().lower()
    if not chosen:
        return detected()
    if chosen not in LEVELS:
        raise SpecdraftError(f"{VARIABLE} must be one of {', '.join(LEVELS)} (or unset to use the best this CPU has), "
                             f"got {chosen!r}.")
    missing = CPU_FLAGS[chosen] - cpu_flags()
    if missing:
        raise SpecdraftError(f"{VARIABLE}={chosen} needs CPU flags this machine lacks ({', '.join(sorted(missing))}); "
                             f"this CPU runs up to {detected()}: set {VARIABLE} to that or lower, or unset it.")
    return chosen


def allows(level: str) -> bool:
    """Whether kernels of `level` may run: it is at or below `isa()`."""
    return LEVELS.index(level) <= LEVELS.index(isa())


def first_built(build, levels: tuple[str, ...] = ("avx512", "avx2")):
    """`build(level)` for the best of `levels` that `allows` and that builds and runs here (not None), or None."""
    return next((built for level in levels if allows(level) and (built := build(level)) is not None), None)


def avx_vnni() -> bool:
    """Whether the AVX2 kernels' int8 dot products run on AVX-VNNI's 256-bit `vpdpbusd` (`avx2_prompt.c`: the same
    bits as `vpmaddubsw` + `vpaddw`, fewer instructions): where the CPU has it (Intel since Alder Lake, AMD Zen 5),
    unless `SPECDRAFT_AVX_VNNI=0` (how an AVX2 CPU without it, such as a Zen 3, is run on one that has it)."""
    setting = os.environ.get(AVX_VNNI_VARIABLE, "").strip()
    if setting not in ("", "0", "1"):
        raise SpecdraftError(f"{AVX_VNNI_VARIABLE} must be 0 or 1 (or unset: on where the CPU has AVX-VNNI), got "
                             f"{setting!r}.")
    has = AVX_VNNI_BUILD[1] <= cpu_flags()
    if setting == "1" and not has:
        raise SpecdraftError(f"{AVX_VNNI_VARIABLE}=1 needs the CPU flag avx_vnni, which this machine lacks; set it to 0 "
                             "or unset it.")
    return has and setting != "0"


def with_avx_vnni(flags: list[str], required: set[str], what: str) -> tuple[list[str], set[str], str]:
    """An AVX2 build's compiler flags, required CPU flags and name, with AVX-VNNI added (`avx_vnni`)."""
    return flags + AVX_VNNI_BUILD[0], required | AVX_VNNI_BUILD[1], what + " with AVX-VNNI"
