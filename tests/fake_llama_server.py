"""A stand-in for llama.cpp's llama-server, for the tests of `bench.llama_server` and its users (no build needed).

Takes llama-server's command line (it reads `--port` and whether `--spec-type` is there) and answers /health,
/props, /v1/models, /completion (token ids in, the prompt's ids cycled out, timings with `draft_n` when speculating) and
streamed /v1/chat/completions. It writes `<pid>.json` (its argv) into `FAKE_LLAMA_DIR`. `FAKE_LLAMA_MODE`:
`ok` (default), `exit` (exits with 3 before listening, as on a bad model file), `crash` (SIGSEGV at the first
/completion), `fail-after-1` (a 500 from the second /completion on).
"""

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ARGV = sys.argv[1:]
MODE = os.environ.get("FAKE_LLAMA_MODE", "ok")
SPECULATING = "--spec-type" in ARGV
COMPLETIONS = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/props":
            self._json(200, {"model_path": ARGV[ARGV.index("-m") + 1]})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/completion":
            self.completion(body)
        elif self.path == "/v1/chat/completions":
            self.chat(body)
        else:
            self._json(404, {"error": "not found"})

    def completion(self, body: dict) -> None:
        if MODE == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)  # the signal may land a moment later: never answer meanwhile
        COMPLETIONS.append(body)
        if MODE == "fail-after-1" and len(COMPLETIONS) > 1:
            self._json(500, {"error": {"message": "fake failure"}})
            return
        prompt = body["prompt"] if isinstance(body["prompt"], list) else [1, 2, 3]
        n = body.get("n_predict", 4)
        tokens = [prompt[i % len(prompt)] for i in range(n)]
        timings = {"prompt_n": len(prompt), "prompt_ms": 10.0 * len(prompt), "predicted_n": n, "predicted_ms": 5.0 * n,
                   "predicted_per_second": 200.0}
        if SPECULATING:
            timings |= {"draft_n": 2 * n, "draft_n_accepted": n}
        self._json(200, {"content": " ".join(map(str, tokens)), "tokens": tokens, "timings": timings,
                         "stop_type": "limit", "echo": body})

    def chat(self, body: dict) -> None:
        words = body["messages"][-1]["content"].split()
        n = body.get("max_tokens", 4)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake-model"}
        for i in range(n):
            delta = {"choices": [{"index": 0, "delta": {"content": words[i % len(words)] + " "}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(base | delta)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
                 "timings": {"predicted_n": n} | ({"draft_n": 2 * n, "draft_n_accepted": n} if SPECULATING else {})}
        self.wfile.write(f"data: {json.dumps(base | usage)}\n\ndata: [DONE]\n\n".encode())


def main() -> None:
    folder = os.environ.get("FAKE_LLAMA_DIR")
    if folder:
        Path(folder, f"{os.getpid()}.json").write_text(json.dumps(ARGV))
    if MODE == "exit":
        print("error: failed to load model 'nowhere.gguf'", flush=True)
        sys.exit(3)
    port = int(ARGV[ARGV.index("--port") + 1])
    print(f"fake llama-server listening on {port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
