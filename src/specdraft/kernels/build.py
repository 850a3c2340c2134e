"""Compile a kernel's C file with the system C compiler on first use and keep it in the cache folder."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from specdraft.paths import cache_dir, partial_path


def _cpuinfo_field(name: str) -> str:
    """The value of the first `name` line of /proc/cpuinfo ('' where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == name), "")
    return line.partition(":")[2].strip()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read), read once: the kernels ask on every
    call which build runs, and reading the file took about 40 µs."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo (`GenuineIntel`, `AuthenticAMD`; '' where unknown)."""
    return _cpuinfo_field("vendor_id")


def source_text(source: Path) -> bytes:
    """`source` and, recursively, every file it includes by `#include "name"` (so a change to any of
    them makes a new build)."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE):
        text += source_text(source.parent / name.decode())
    return text


def compiled_library(source: Path, flags: list[str], required_cpu_flags: set[str], what: str,
                     name: str | None = None) -> ctypes.CDLL | None:
    """`source` built with `flags` (cached as `name` (default: the source's stem) and a hash of both and of what it
    includes), or None where it cannot be built or run here (a CPU flag missing, no compiler, a failed build).
    Whether a build may run is the caller's question (`NumericConfig.allows`: `SPECDRAFT_ISA=torch` turns every native
    kernel off)."""
    if not required_cpu_flags <= cpu_flags():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None

    key = hashlib.sha256(source_text(source) + " ".join(flags).encode()).hexdigest()[:16]
    built = cache_dir() / "kernels" / f"{name or source.stem}-{key}.so"
    if not built.is_file():
        built.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(built)
        print(f"note: building {what} (once; cached in {built.parent})", file=sys.stderr)
        result = subprocess.run([compiler, *flags, str(source), "-o", str(partial)], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"note: {what} did not build ({result.stderr.strip()[:300]}); falling back to PyTorch kernels",
                  file=sys.stderr)
            return None
        os.replace(partial, built)
    return ctypes.CDLL(str(built))


def bind(library: ctypes.CDLL | None, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """`library` with each function of `signatures` that it has given its argument types (and no result), or None."""
    if library is not None:
        for name, argtypes in signatures.items():
            function = getattr(library, name, None)
            if function is not None:
                function.argtypes, function.restype = argtypes, None
    return library
