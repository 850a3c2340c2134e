"""The llama.cpp peers of `specdraft loadtest --peer llama-server`: llama-server under the same load as `specdraft serve`.

At each concurrency C the load test starts, for each peer method in its turn among the methods, a llama-server
with C slots (`-np C`: continuous batching; each slot `context` tokens), drives it with the same streaming chat
clients, prompts, budget and greedy settings as the specdraft server, and stops it (a cold server per level, as
the specdraft server forgets its prefixes before each level):

| method              | llama-server runs the target's GGUF file with                          |
| ------------------- | ---------------------------------------------------------------------- |
| `llama-server`      | nothing more: plain decoding                                             |
| `llama-server-spec` | `-md DRAFT --spec-type draft-simple` (its defaults: 3 draft tokens a step) |

The server applies the chat template the GGUF file carries (llama.cpp's jinja engine; ours renders the same
template from the same file). Threads: `threads` for prompt, generation and draft, which should be what the
specdraft server was started with (`specdraft serve --threads`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specdraft.bench.llama_server import LlamaServer, ServerSettings, arguments
from specdraft.errors import SpecdraftError

PEERS = {"llama-server": ("llama-server", "llama-server-spec")}  # --peer NAME: the methods it adds
CONTEXT = 4096  # tokens per slot: a prompt of the shipped sets and its budget, with room to spare


@dataclass(frozen=True)
class Peer:
    """What the peer servers run: the target's and the draft's GGUF files, threads, and context per slot."""

    target: Path
    draft: Path
    threads: int
    context: int = CONTEXT

    def settings(self, method: str, slots: int) -> ServerSettings:
        """The server of `method` with `slots` slots."""
        spec = ("-md", str(self.draft), "--spec-type", "draft-simple") if method == "llama-server-spec" else ()
        return ServerSettings(self.target, self.threads, self.context, slots, spec)

    def command(self, method: str, slots: int) -> str:
        """The command line a level of `method` runs (for the summary; the port is chosen at each start)."""
        return " ".join(arguments(self.settings(method, slots), port=0))

    @contextlib.contextmanager
    def serving(self, method: str, slots: int) -> Iterator[str]:
        """A started server of `method` with `slots` slots, stopped on leaving; yields its URL."""
        with LlamaServer(self.settings(method, slots)) as server:
            yield server.url


def peer_methods(peer: str | None) -> tuple[str, ...]:
    """The methods `--peer` adds (none without it); a clear error for an unknown peer."""
    if not peer:
        return ()
    if peer not in PEERS:
        raise SpecdraftError(f"--peer takes {', '.join(PEERS)}; got {peer!r}.")
    return PEERS[peer]


def make_peer(peer: str | None, target: str, draft: str, threads: int) -> Peer | None:
    """The `Peer` of `--peer` (None without it): `target` and `draft` (bundled names or paths) as GGUF files, the
    llama-server binary there; clear errors before any load is sent."""
    if not peer_methods(peer):
        return None
    from specdraft.bench.llama_cpp_peer import target_gguf
    from specdraft.bench.llama_server import server_binary

    server_binary()
    return Peer(target_gguf(target, "llama-server"), target_gguf(draft, "llama-server-spec", role="draft"), threads)
