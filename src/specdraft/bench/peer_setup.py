"""`make peers`: llama.cpp's peers from one pinned source, each run for a few tokens before it is kept.

```
the sdist of llama-cpp-python PINNED: found (llama_cpp_build.find_sdist), else `pip download`ed into llama_cpp_dir()/sdist
tools:  for each build of llama_cpp_build.builds_to_try() (native first; without AMX where the CPU has it):
            build llama-server and llama-bench; run each for a few tokens on the bundled target
            the first build whose tools both run is kept; a crash moves on to the next build
python: llama-cpp-python as installed, if it is PINNED and runs; else for each build to try:
            pip install the sdist with that build's CMake arguments (no wheel cache: another build's wheel
            must not come back), run it for a few tokens, keep the first that runs
record: llama_cpp_dir()/peers.json (llama_cpp_build.keep): each part's build, CMake arguments and smoke output,
        and the builds that failed and why; the bench's machine block reports it
```

A second `make peers` finds both parts recorded and in place and only checks that (`--force` runs it all again).
The smoke runs are what a crash shows up in: on a 2-core Xeon whose OS grants AMX, llama.cpp's native build dies
(llama-bench with SIGILL here; segfaults at the first generated token in an earlier build, in the tools and in
llama-cpp-python alike), and the build without AMX runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import subprocess
import sys
from pathlib import Path

from specdraft.bench import llama_cpp_build
from specdraft.bench.llama_cpp_build import CMAKE_FLAGS, Build, build_tools, builds_to_try, find_sdist, keep, kept
from specdraft.bench.llama_server import LlamaServer, ServerSettings, exit_text
from specdraft.errors import SpecdraftError

PINNED = "0.3.36"  # llama-cpp-python, whose vendor/llama.cpp every peer is built from
TOOLS = ("llama-server", "llama-bench")
SMOKE_TOKENS = 8
SMOKE_PROMPT = "def add(a, b):"
SMOKE_TIMEOUT = 600  # seconds for one smoke run (loading and repacking the model included)


def sdist(version: str = PINNED) -> Path:
    """llama-cpp-python's sdist of `version`: found, else downloaded with pip into llama_cpp_dir()/sdist."""
    found = find_sdist(version)
    if found is not None:
        return found
    folder = llama_cpp_build.llama_cpp_dir() / "sdist"
    folder.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                          f"llama-cpp-python=={version}", "-d", str(folder)])
    found = find_sdist(version)
    if run.returncode or found is None:
        raise SpecdraftError(f"Could not download llama-cpp-python {version}'s sdist; download it yourself "
                             "and set SPECDRAFT_LLAMA_CPP_SDIST to it.")
    return found


# ----- smoke runs: a few tokens each; a text of what they printed, or a SpecdraftError saying how they failed -------
def _tail(output: str) -> str:
    """`: <the output's last 1500 characters>`, or "" for no output."""
    output = output.strip()
    return f": {output[-1500:]}" if output else ""


def smoke_bench(binary: Path, model: Path, threads: int) -> str:
    """`llama-bench` for a 16-token prompt pass and SMOKE_TOKENS generated tokens: its table."""
    run = subprocess.run([str(binary), "-m", str(model), "-p", "16", "-n", str(SMOKE_TOKENS), "-r", "1", "-t",
                          str(threads)], capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    if run.returncode:
        raise SpecdraftError(f"llama-bench {exit_text(run.returncode)}{_tail(run.stderr or run.stdout)}")
    return "\n".join(line for line in run.stdout.splitlines() if line.startswith("|"))


def smoke_server(binary: Path, model: Path, threads: int) -> str:
    """`llama-server` answering one greedy completion of SMOKE_TOKENS tokens: its text and speed."""
    settings = ServerSettings(model, threads, context=512, binary=binary)
    with LlamaServer(settings, start_timeout=SMOKE_TIMEOUT) as server:
        answer = server.post("/completion", {"prompt": SMOKE_PROMPT, "n_predict": SMOKE_TOKENS, "temperature": 0.0},
                             timeout=SMOKE_TIMEOUT)
    timings = answer.get("timings", {})
    return (f"{SMOKE_PROMPT!r} -> {answer.get('content', '')!r}: {timings.get('predicted_n')} tokens at "
            f"{timings.get('predicted_per_second', 0):.1f} tok/s")


PYTHON_SMOKE = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), verbose=False)
out = llm(sys.argv[3], max_tokens=int(sys.argv[4]), temperature=0.0)
print(repr(out["choices"][0]["text"]))
print(llama_cpp.llama_print_system_info().decode().strip())
"""


def smoke_python(model: Path, threads: int) -> tuple[str, str]:
    """llama-cpp-python (in a child process, so a crash is a result) generating SMOKE_TOKENS tokens: its text and
    `llama_print_system_info()`."""
    run = subprocess.run([sys.executable, "-c", PYTHON_SMOKE, str(model), str(threads), SMOKE_PROMPT,
                          str(SMOKE_TOKENS)], capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    if run.returncode:
        raise SpecdraftError(f"llama-cpp-python {exit_text(run.returncode)}{_tail(run.stderr)}")
    text, _, info = run.stdout.strip().partition("\n")
    return f"{SMOKE_PROMPT!r} -> {text}", info


# ----- the two parts -----------------------------------------------------------------------------------------
def setup_tools(model: Path, threads: int, jobs: int, say=print) -> dict:
    """Build llama-server and llama-bench, smoke them, fall back to the next build on a failure; the kept record."""
    failed = []
    for build in builds_to_try():
        say(f"llama.cpp tools, build {build.name} ({shlex.join(build.args)}): building {', '.join(TOOLS)} "
            f"(log: {llama_cpp_build.llama_cpp_dir() / 'build.log'})")
        folder = build_tools(list(TOOLS), build, jobs)
        try:
            smoke = {"llama-bench": smoke_bench(folder / "llama-bench", model, threads),
                     "llama-server": smoke_server(folder / "llama-server", model, threads)}
        except (SpecdraftError, subprocess.TimeoutExpired) as error:
            say(f"  build {build.name} does not run here: {error}")
            failed.append({"build": build.name, "why": str(error)[:2000]})
            continue
        for tool, text in smoke.items():
            say(f"  {tool} runs:\n{text}")
        return {"build": build.name, "cmake_args": CMAKE_FLAGS + list(build.args), "bin": str(folder),
                "source": f"llama-cpp-python {PINNED}", "smoke": smoke, "failed": failed}
    raise SpecdraftError("No build of llama.cpp's tools runs on this machine: "
                         + "; ".join(f"{f['build']}: {f['why'][:300]}" for f in failed))


def installed_version() -> str | None:
    """The installed llama-cpp-python's version, or None."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_install(source: Path, build: Build, jobs: int) -> None:
    """Install llama-cpp-python from `source` built with `build`'s CMake arguments (replacing any install)."""
    env = os.environ | {"CMAKE_ARGS": shlex.join(build.args), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    run = subprocess.run(["nice", "-n", "10", sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-cache-dir", "--force-reinstall", str(source)], env=env)
    if run.returncode:
        raise SpecdraftError(f"pip could not build llama-cpp-python from {source} ({build.name}); see its output above.")


def setup_python(model: Path, threads: int, jobs: int, say=print) -> dict:
    """llama-cpp-python that runs: as installed (PINNED), else installed build by build; the kept record."""
    failed = []
    if installed_version() == PINNED:
        try:
            text, info = smoke_python(model, threads)
            say(f"llama-cpp-python {PINNED} (installed earlier) runs: {text}\n  {info}")
            return {"build": "installed earlier", "version": PINNED, "smoke": text, "system_info": info, "failed": []}
        except (SpecdraftError, subprocess.TimeoutExpired) as error:
            say(f"llama-cpp-python {PINNED} as installed does not run here: {error}")
            failed.append({"build": "installed earlier", "why": str(error)[:2000]})
    source = sdist()
    for build in builds_to_try():
        say(f"llama-cpp-python {PINNED}, build {build.name}: pip install {source.name} "
            f"with CMAKE_ARGS={shlex.join(build.args)} (about 5 minutes on 2 cores)")
        pip_install(source, build, jobs)
        try:
            text, info = smoke_python(model, threads)
        except (SpecdraftError, subprocess.TimeoutExpired) as error:
            say(f"  build {build.name} does not run here: {error}")
            failed.append({"build": build.name, "why": str(error)[:2000]})
            continue
        say(f"  runs: {text}\n  {info}")
        return {"build": build.name, "version": PINNED, "cmake_args": list(build.args), "smoke": text,
                "system_info": info, "failed": failed}
    raise SpecdraftError("No build of llama-cpp-python runs on this machine: "
                         + "; ".join(f"{f['build']}: {f['why'][:300]}" for f in failed))


def up_to_date(part: str) -> bool:
    """Whether `part` is recorded as kept and still in place (the tools' binaries, the installed package)."""
    entry = kept().get(part) or {}
    if part == "tools":
        return entry.get("source") == f"llama-cpp-python {PINNED}" and all(
            llama_cpp_build.kept_tool(tool) is not None for tool in TOOLS)
    return bool(entry) and entry.get("version") == PINNED == installed_version()


def setup_peers(model: Path, threads: int, jobs: int = 2, force: bool = False, say=print) -> dict:
    """Both parts (module doc), each skipped when it is up to date (unless `force`); the record. The sdist is found
    or downloaded before either part is built: the tools build from its vendored source too."""
    for part, setup in (("tools", setup_tools), ("llama_cpp_python", setup_python)):
        if not force and up_to_date(part):
            say(f"{part}: kept build {kept()[part]['build']!r} is in place ({llama_cpp_build.llama_cpp_dir() / llama_cpp_build.KEPT})")
            continue
        sdist()
        keep(part, setup(model, threads, jobs, say))
    return kept()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdraft.bench.peer_setup",
                                     description="Build llama.cpp's peers (llama-server, llama-bench, llama-cpp-python) "
                                                 "and keep the builds that run on this CPU.")
    parser.add_argument("--model", default=None, help="GGUF file for the smoke runs (default: the bundled target)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--force", action="store_true", help="build and smoke again even where a build is kept")
    args = parser.parse_args(argv)
    try:
        if args.model is None:
            from specdraft.models.loading import resolve_model_path
            from specdraft.models.registry import DEFAULT_TARGET

            model = resolve_model_path(DEFAULT_TARGET)[1]
        else:
            model = Path(args.model)
        record = setup_peers(model, args.threads, args.jobs, args.force)
    except SpecdraftError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"kept: tools {record['tools']['build']!r}, llama-cpp-python {record['llama_cpp_python']['build']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
