"""What this CPU offers the native kernels: the instruction-set levels, the CPU flags each needs, the highest this
machine has, and its preferred AVX-512 dot product. Which level runs is `numerics`' choice (`SPECDRAFT_ISA`).

The levels build on each other: `torch` (no native kernel: PyTorch's own), `avx2` (AVX2 + FMA + F16C: the AVX2
library), `avx512` (AVX-512 with VNNI and BF16: the AVX-512 library), `amx` (the AVX-512 library built with AMX's
tiles too, where the OS grants them). Each library fills the same slots (`bindings.SLOTS`). A CPU with AVX-512 VNNI
but not BF16 (Cascade Lake, Ice Lake) runs the AVX2 library.
"""

from __future__ import annotations

from functools import lru_cache

from specdraft.kernels.build import cpu_flags, cpu_vendor

LEVELS = ("torch", "avx2", "avx512", "amx")  # each level's kernels add to those below it
CPU_FLAGS = {  # what a level needs of /proc/cpuinfo's flags
    "torch": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "fma"},
    "amx": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "fma", "amx_tile", "amx_bf16"},
}
AVX_VNNI_CPU_FLAGS = {"avx_vnni"}  # what the AVX2 library's AVX-VNNI build needs


@lru_cache(maxsize=1)
def detected() -> str:
    """The highest level whose CPU flags this machine has (whether the OS grants AMX is asked when its build loads)."""
    flags = cpu_flags()
    return next(level for level in reversed(LEVELS) if CPU_FLAGS[level] <= flags)


def preferred_tile_dots() -> str:
    """bf16 on AMD CPUs with AVX-512 BF16 (`vdpbf16ps` and `vpdpwssd` issue alike there, and bf16 needs a third of
    int16's float work per group), else int16 (on Intel `vdpbf16ps` is the slower one)."""
    return "bf16" if cpu_vendor() == "AuthenticAMD" and "avx512_bf16" in cpu_flags() else "int16"
