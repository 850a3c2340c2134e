"""A live specdraft server on loopback over the tiny saved models, for the tests that drive one over HTTP."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import uvicorn

from specdraft.surfaces.server_app import build_app


def make_app(dirs, **overrides):
    """The app `specdraft serve` would build over the tiny target and draft (float32, draft not quantized)."""
    options = dict(api_key=None, served_model_name=None, max_queue=64, request_timeout=60.0, max_tokens=16,
                   shutdown_grace=2.0, seed=None, target=str(dirs["target"]), draft=str(dirs["draft"]), drafter="model",
                   k="3", tree_budget=0, tree_branch=4, draft_quant="none", draft_vocab=0, dtype="float32",
                   device="cpu", gguf_weights="auto", draft_confidence=None, ngram_max=None, ngram_min=None,
                   suffix_min_match=None, suffix_min_score=None, suffix_factor=None, exit_layer=None, trained=None)
    return build_app(**{**options, **overrides})


class Live:
    """A uvicorn server in a background thread on a free loopback port."""

    def __init__(self, app, grace: float | None = None) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Live":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 20) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            self.stop()

    def client(self, key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, **kw)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_until(self, condition, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.health()):
            assert time.monotonic() < deadline, f"timed out; health {self.health()}"
            time.sleep(0.02)
