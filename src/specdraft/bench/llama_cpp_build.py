"""How llama.cpp is built here, one way for everything that needs it: `llama-quantize` (`bench.random_gguf`), the
`llama-server` and `llama-bench` peers and llama-cpp-python (`make peers`, `bench.peer_setup`).

Source: llama-cpp-python's sdist (pinned in the Makefile), whose `vendor/llama.cpp` is extracted once into
`llama_cpp_dir()/source`, so the Python binding and the tools are the same llama.cpp. The sdist is
`SPECDRAFT_LLAMA_CPP_SDIST`, else the first one found in `SDIST_GLOBS` (`make peers` downloads it into
`llama_cpp_dir()/sdist`).

Builds: `-DGGML_NATIVE=ON` compiles llama.cpp with `-march=native`, so it uses every instruction set this CPU
has. One of them can be unusable: a CPU with AMX (`amx_tile` in /proc/cpuinfo) runs AMX instructions only after
the kernel grants the process the tile state (Linux 5.16 and later, on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)). Where that request fails, a native build dies with SIGILL at its first `tilezero`; and
where it succeeds, a native build can still crash (on a 2-core Xeon here: SIGILL in llama-bench, segfaults at the
first generated token on a 2-core Xeon with AMX). So there are two builds (`BUILDS`), each in its own folder under `llama_cpp_dir()`:

| build    | CMake arguments            | folder        | used by                                          |
| -------- | -------------------------- | ------------- | ------------------------------------------------ |
| `native` | `NATIVE`                   | `build-native`| the peers first, where the OS grants AMX or the CPU has none |
| `no-amx` | `NATIVE + NO_AMX`          | `build`       | llama-quantize (needs no AMX); the peers where `native` cannot or did not run |

`NO_AMX` turns AMX off twice: the `GGML_AMX_*` options (which a non-native build reads) and `-mno-amx-*`
compiler flags (which a native build needs: with `-march=native` ggml ignores `GGML_AMX_*`, and GCC lets an
explicit `-mno-...` flag win over what `-march=native` turns on). `builds_to_try()` orders them for this machine;
`bench.peer_setup` runs each built peer for a few tokens and falls back to the next build when one crashes.

Builds run under `nice -n 10` with `jobs` parallel jobs (2 by default: the cores are shared), logging to
`llama_cpp_dir()/build.log`; a tool already built is returned at once.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import platform
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.paths import cache_dir

NATIVE = ["-DGGML_NATIVE=ON"]
NO_AMX_COMPILER_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
          f"-DCMAKE_C_FLAGS={NO_AMX_COMPILER_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_COMPILER_FLAGS}"]
# What every tools build sets besides the CPU flags: a static CPU build of the tools and the server, without
# HTTPS, downloads (curl; the web UI's prebuilt assets) or tests.
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF"]
SYS_ARCH_PRCTL = 158  # x86-64's syscall number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@dataclass(frozen=True)
class Build:
    """One way of building llama.cpp: its name, CMake arguments beyond `CMAKE_FLAGS`, and folder."""

    name: str
    args: tuple[str, ...]
    folder: str

    @property
    def bin(self) -> Path:
        """Where its tools land."""
        return llama_cpp_dir() / self.folder / "bin"


# `no-amx` keeps the folder llama-quantize was always built in, so an existing cache stays valid.
BUILDS = {"native": Build("native", tuple(NATIVE), "build-native"),
          "no-amx": Build("no-amx", tuple(NATIVE + NO_AMX), "build")}


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


def builds_to_try(flags: set[str] | None = None, granted=amx_granted) -> list[Build]:
    """The builds to try on this machine, best first: `native` unless the OS refuses AMX, then `no-amx` where the
    CPU has AMX (its native build may still crash); a CPU without AMX has only `native`."""
    flags = cpu_flags() if flags is None else flags
    if "amx_tile" not in flags:
        return [BUILDS["native"]]
    if amx_unusable(flags, granted):
        return [BUILDS["no-amx"]]
    return [BUILDS["native"], BUILDS["no-amx"]]


def cmake_args(flags: set[str] | None = None, granted=amx_granted) -> list[str]:
    """The first build's CMake arguments: `-DGGML_NATIVE=ON`, with AMX off where `amx_unusable`."""
    return list(builds_to_try(flags, granted)[0].args)


# ----- the source and the tools ------------------------------------------------------------------------------
def llama_cpp_dir() -> Path:
    """Where llama.cpp's source, sdist and builds live: the cache folder's `llama.cpp`."""
    return cache_dir() / "llama.cpp"


def sdist_globs() -> list[str]:
    """Where an sdist of llama-cpp-python is looked for (after `SPECDRAFT_LLAMA_CPP_SDIST`)."""
    return [str(llama_cpp_dir() / "sdist" / "llama_cpp_python-*.tar.gz"), "/tmp/peer/sdist/llama_cpp_python-*.tar.gz"]


def find_sdist(version: str | None = None) -> Path | None:
    """llama-cpp-python's sdist (of `version`, when given), or None."""
    candidates = [os.environ.get("SPECDRAFT_LLAMA_CPP_SDIST", "")] + [p for g in sdist_globs() for p in sorted(glob.glob(g))]
    found = (Path(p) for p in candidates if p and Path(p).is_file())
    return next((p for p in found if version is None or p.name == f"llama_cpp_python-{version}.tar.gz"), None)


def extract_source(sdist: Path, target: Path) -> None:
    """llama-cpp-python's sdist's `vendor/llama.cpp` as `target`."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        archive.extractall(staging, members=members, filter="data")
    (root,) = staging.glob("*/vendor/llama.cpp")
    root.rename(target)
    shutil.rmtree(staging)


def source_dir() -> Path:
    """llama.cpp's source, extracted from the sdist on first use."""
    source = llama_cpp_dir() / "source"
    if not (source / "CMakeLists.txt").is_file():
        sdist = find_sdist()
        if sdist is None:
            raise SpecdraftError("Building llama.cpp needs its source: run `make peers` (downloads llama-cpp-python's "
                                 "sdist), or set SPECDRAFT_LLAMA_CPP_SDIST to that sdist "
                                 "(pip download --no-binary :all: --no-deps llama-cpp-python==VERSION).")
        source.parent.mkdir(parents=True, exist_ok=True)
        extract_source(sdist, source)
    return source


def configure_command(build: Build, source: Path, generator: list[str]) -> list[str]:
    """The CMake configure command of `build` (its folder, `CMAKE_FLAGS`, its CPU arguments)."""
    return ["cmake", "-S", str(source), "-B", str(llama_cpp_dir() / build.folder), *generator, *CMAKE_FLAGS,
            *build.args]


def build_tools(targets: list[str], build: Build, jobs: int = 2) -> Path:
    """The `targets` (`llama-quantize`, `llama-server`, `llama-bench`, ...) of `build`, built where missing (nice 10,
    `jobs` jobs); their folder. A SpecdraftError naming the log when a step fails."""
    missing = [t for t in targets if not (build.bin / t).is_file()]
    if not missing:
        return build.bin
    source = source_dir()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    steps = [configure_command(build, source, generator),
             ["cmake", "--build", str(llama_cpp_dir() / build.folder), "--target", *missing, "-j", str(jobs)]]
    log_path = llama_cpp_dir() / "build.log"
    with open(log_path, "a") as log:
        for step in steps:
            log.write(f"$ {shlex.join(step)}\n")
            log.flush()
            if subprocess.run(["nice", "-n", "10", *step], stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SpecdraftError(f"Building {', '.join(missing)} ({build.name}) failed: see {log_path}.")
    return build.bin


# ----- what `make peers` kept ----------------------------------------------------------------------------------
KEPT = "peers.json"  # in llama_cpp_dir(): {"tools": {...}, "llama_cpp_python": {...}} (see bench.peer_setup)


def kept() -> dict:
    """The record of the builds `make peers` kept (empty before it ran, or where the record is unreadable)."""
    try:
        record = json.loads((llama_cpp_dir() / KEPT).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def keep(part: str, entry: dict) -> None:
    """Record `entry` as what was kept for `part` (`tools` or `llama_cpp_python`)."""
    record = kept() | {part: entry}
    path = llama_cpp_dir() / KEPT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def kept_tool(name: str) -> Path | None:
    """The kept build's `name` (`llama-server`, `llama-bench`), or None where none was kept or it is gone."""
    tools = kept().get("tools") or {}
    build = BUILDS.get(tools.get("build", ""))
    return build.bin / name if build is not None and (build.bin / name).is_file() else None
