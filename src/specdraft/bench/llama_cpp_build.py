"""The CMake arguments `make peers` builds llama-cpp-python with: llama.cpp's native CPU detection, AMX off
only where the CPU has AMX but the OS does not grant its tile state.

`-DGGML_NATIVE=ON` compiles llama.cpp with `-march=native`, so it uses every instruction set this CPU
has. One of them can be unusable: a CPU with AMX (`amx_tile` in /proc/cpuinfo) runs AMX instructions
only after the kernel grants the process the tile state (Linux 5.16 and later, on request:
arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). Where that request fails, a native build dies with
SIGILL at its first `tilezero`. There AMX is turned off: the `GGML_AMX_*` options (which a non-native
build reads) and `-mno-amx-*` compiler flags (which a native build needs: with `-march=native` ggml
ignores `GGML_AMX_*`, and GCC lets an explicit `-mno-...` flag win over what `-march=native` turns on).

Stdlib only, so `make peers` runs it as a script (`python src/specdraft/bench/llama_cpp_build.py`
prints the arguments) before anything heavy is imported.
"""

from __future__ import annotations

import ctypes
import platform
import shlex
from pathlib import Path

NATIVE = ["-DGGML_NATIVE=ON"]
NO_AMX_COMPILER_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
          f"-DCMAKE_C_FLAGS={NO_AMX_COMPILER_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_COMPILER_FLAGS}"]
SYS_ARCH_PRCTL = 158  # x86-64's syscall number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == "flags"), "")
    return set(line.partition(":")[2].split())


def amx_granted() -> bool:
    """Whether the OS grants this process AMX's tile state (the request llama.cpp's AMX code would need)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def amx_unusable(flags: set[str] | None = None, granted=amx_granted) -> bool:
    """The CPU has AMX (so `-march=native` would emit it) but the OS does not grant its tile state."""
    return "amx_tile" in (cpu_flags() if flags is None else flags) and not granted()


def cmake_args(flags: set[str] | None = None, granted=amx_granted) -> list[str]:
    """`-DGGML_NATIVE=ON`, with AMX off where `amx_unusable`."""
    return NATIVE + (NO_AMX if amx_unusable(flags, granted) else [])


if __name__ == "__main__":
    print(shlex.join(cmake_args()))
