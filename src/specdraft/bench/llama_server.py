"""A llama.cpp `llama-server` process that the bench, the load test and `make peers` start, use and always stop.

binary     `server_binary()`: `SPECDRAFT_LLAMA_SERVER`, else the one in the build `make peers` kept
           (`llama_cpp_build.kept()`), else a SpecdraftError that says to run `make peers`
settings   `ServerSettings`: the model file, threads, context per slot, slots (`-np`) and the speculation flags
           (`spec`: llama.cpp's own, e.g. `-md DRAFT --spec-type draft-simple --spec-draft-n-max 8`);
           `arguments(settings, port)` is the command line: loopback, every thread count the same (prompt and
           draft too), the context `slots` times the slot's (llama.cpp splits it among the slots), no web UI
process    `LlamaServer(settings)`: started on 127.0.0.1 at a free port with its output in a log file, ready once
           `/health` answers 200 and `/props` names its model file (so another server that took the port is not
           taken for it). A server that exits before that, or is not ready within `start_timeout`
           seconds, is a SpecdraftError naming the binary and the log (with its last lines). `close()` ends it
           (SIGTERM, then SIGKILL) and may be called any number of times; a server still running when Python
           exits is ended then, and on Linux the server gets SIGTERM if this process dies first
requests   `post(route, body)`: one JSON request (stdlib HTTP), its JSON answer
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

HOST = "127.0.0.1"
BINARY_ENV = "SPECDRAFT_LLAMA_SERVER"
LOG_TAIL_LINES = 15  # of the server's log, in an error
DEATH_WAIT_SECONDS = 5.0  # a request that failed waits this long for the process to end, to say how it ended
PR_SET_PDEATHSIG = 1


def server_binary() -> Path:
    """The llama-server to run: `SPECDRAFT_LLAMA_SERVER`, else the kept build's; a clear error where there is none."""
    from specdraft.bench.llama_cpp_build import kept_tool

    given = os.environ.get(BINARY_ENV)
    if given:
        if not Path(given).is_file():
            raise SpecdraftError(f"{BINARY_ENV}={given} is not a file; point it at a llama-server binary.")
        return Path(given)
    binary = kept_tool("llama-server")
    if binary is None:
        raise SpecdraftError("The llama-server peers need llama.cpp's llama-server: run `make peers` (builds it from "
                             f"the pinned llama.cpp source, 20-30 minutes on 2 cores), or set {BINARY_ENV}.")
    return binary


def build_info() -> dict:
    """For the bench's machine block: the llama-server binary and, where it is the build `make peers` kept, that
    build's name and CMake arguments (None where the binary came from `SPECDRAFT_LLAMA_SERVER`)."""
    from specdraft.bench.llama_cpp_build import kept, kept_tool

    binary = server_binary()
    ours = kept_tool("llama-server")
    tools = (kept().get("tools") or {}) if ours is not None and ours.resolve() == binary.resolve() else {}
    return {"binary": str(binary), "build": tools.get("build"), "cmake_args": tools.get("cmake_args")}


@dataclass(frozen=True)
class ServerSettings:
    """What a llama-server is started with (the same settings: the same server)."""

    model: Path
    threads: int
    context: int  # tokens per slot
    slots: int = 1
    spec: tuple[str, ...] = ()  # llama.cpp's speculation flags (none: plain decoding)
    binary: Path | None = None  # None: `server_binary()`


def arguments(settings: ServerSettings, port: int) -> list[str]:
    """The command line of a server with `settings` on loopback at `port`."""
    binary = settings.binary or server_binary()
    threads = str(settings.threads)
    drafting = "-md" in settings.spec or "--spec-draft-model" in settings.spec
    return [str(binary), "-m", str(settings.model), "--host", HOST, "--port", str(port),
            "-t", threads, "-tb", threads, *(["-td", threads, "-tbd", threads] if drafting else []),
            "-c", str(settings.context * settings.slots), "-np", str(settings.slots), "--no-webui", *settings.spec]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec (Linux: SIGTERM when this process dies)
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ("" where it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def exit_text(returncode: int) -> str:
    """How a process ended, in words: `crashed (SIGSEGV)` for a signal, else `exited with N`."""
    if returncode < 0:
        try:
            return f"crashed ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"crashed (signal {-returncode})"
    return f"exited with {returncode}"


_RUNNING: "weakref.WeakSet[LlamaServer]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for server in list(_RUNNING):
        server.close()


class LlamaServer:
    """One llama-server process (see the module doc); use it as a context manager or call `close()`."""

    def __init__(self, settings: ServerSettings, start_timeout: float = 300.0, log_dir: Path | None = None):
        self.settings = settings
        self.port = free_port()
        self.command = arguments(settings, self.port)
        folder = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"llama-server-{os.getpid()}-{self.port}.log"
        self._log = open(self.log_path, "w")
        self._log.write(f"$ {shlex.join(self.command)}\n")
        self._log.flush()
        try:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT,
                                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as error:
            self._log.close()
            raise SpecdraftError(f"llama-server could not start ({self.command[0]}): {error}.") from None
        _RUNNING.add(self)
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """Its address (`http://127.0.0.1:PORT`)."""
        return f"http://{HOST}:{self.port}"

    def failure(self, what: str) -> SpecdraftError:
        """An error about this server that names its binary and its log, with the log's last lines."""
        tail = log_tail(self.log_path)
        return SpecdraftError(f"llama-server {what} ({self.command[0]}; log: {self.log_path})"
                              + (f":\n{tail}" if tail else "."))

    def _get(self, route: str) -> dict | None:
        """GET `route`'s JSON, or None while nothing (or not a 200) answers there."""
        try:
            with urllib.request.urlopen(f"{self.url}{route}", timeout=5) as answer:
                return json.loads(answer.read()) if answer.status == 200 else None
        except (urllib.error.URLError, OSError, ValueError):
            return None  # not listening yet, or 503 while it loads the model

    def _wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 and /props names our model file (not another server that took the port)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.failure(f"{exit_text(self.process.returncode)} before it was ready")
            if self._get("/health") is not None and (self._get("/props") or {}).get("model_path") == str(
                    self.settings.model):
                return
            time.sleep(0.1)
        raise self.failure(f"was not ready within {timeout:.0f} s")

    def post(self, route: str, body: dict, timeout: float = 3600.0) -> dict:
        """POST `body` as JSON to `route`; the JSON answer. A server error or a dead server is a SpecdraftError."""
        request = urllib.request.Request(f"{self.url}{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            raise self.failure(f"answered {route} with {error.code}: {error.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # also an answer cut short
            try:  # a crashed process may take a moment to end (longer on a loaded machine): say how it ended
                state = exit_text(self.process.wait(timeout=DEATH_WAIT_SECONDS))
            except subprocess.TimeoutExpired:
                state = "did not answer"
            raise self.failure(f"{state} at {route} ({error})") from None

    def close(self) -> None:
        """End the process (SIGTERM, SIGKILL after 10 s) and close its log; safe to call again."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
        _RUNNING.discard(self)

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
