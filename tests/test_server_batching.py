"""The server with continuous batching (`--max-batch`): concurrent clients get what they get one at a time,
streamed or not, with `n`, logprobs and disconnects, and the engine keeps serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import Live, make_app

MODEL = "target"
PROMPTS = ["the quick brown fox", "hello there, how are", "one two three four five", "a b c d e f g",
           "tell me a story", "why is the sky", "def add(a, b):", "list of primes"]


def ask(server: Live, prompt: str, stream: bool, drafter: str | None = None) -> str:
    client = server.client()
    extra = {"speculative": {"drafter": drafter}} if drafter else None
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=12, temperature=0.0, extra_body=extra)
        return out.choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=12, temperature=0.0, stream=True, extra_body=extra)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model_dirs):
    with Live(make_app(tiny_model_dirs)) as server:
        yield {(p, d): ask(server, p, False, d) for p in PROMPTS for d in (None, "none", "ngram")}


def test_concurrent_clients_get_their_one_at_a_time_answers(tiny_model_dirs, one_at_a_time):
    with Live(make_app(tiny_model_dirs, max_batch=4)) as server:
        jobs = [(p, stream, d) for p in PROMPTS for stream in (False, True) for d in (None, "none", "ngram")]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda job: ask(server, *job), jobs))
        for (prompt, _, drafter), answer in zip(jobs, answers):
            assert answer == one_at_a_time[(prompt, drafter)], (prompt, drafter)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'status="500"' not in metrics
        sizes = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("specdraft_batch_size_bucket")}
        assert sizes['le="1"'] < sizes['le="4"'] == sizes['le="+Inf"'] > 0  # steps of several sequences, none above 4
        assert "specdraft_batch_draft_tokens_count" in metrics and "specdraft_batch_goodput_tokens_per_second_sum" in metrics
        server.wait_until(lambda health: health["running"] == 0 and health["queue_depth"] == 0)


@pytest.mark.slow  # a load test (16 s on 2 cores); 32 streaming clients run in the quick set (test_server)
def test_64_concurrent_streams_three_times_over_get_their_answers_without_an_error(tiny_model_dirs, one_at_a_time):
    """The bounded load test: 64 streaming clients at once, three rounds, against a batch of 8 and a queue of 64:
    every request is answered (no 429, no 5xx), each with its one-at-a-time answer, and the server ends idle."""
    with Live(make_app(tiny_model_dirs, max_batch=8, max_queue=64)) as server:
        for _ in range(3):
            with ThreadPoolExecutor(64) as pool:
                answers = list(pool.map(lambda i: ask(server, PROMPTS[i % len(PROMPTS)], True), range(64)))
            assert answers == [one_at_a_time[(PROMPTS[i % len(PROMPTS)], None)] for i in range(64)]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'status="429"' not in metrics and 'status="500"' not in metrics
        server.wait_until(lambda health: health["running"] == 0 and health["queue_depth"] == 0)


def test_n_logprobs_and_a_disconnect_in_a_batch(tiny_model_dirs):
    with Live(make_app(tiny_model_dirs, max_batch=3, max_tokens=24)) as server:
        client = server.client()
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                             max_tokens=8, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
        assert len(out.choices) == 2 and all(c.logprobs.content for c in out.choices)
        assert all(len(t.top_logprobs) == 2 for c in out.choices for t in c.logprobs.content)
        again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                               max_tokens=8, temperature=1.0, seed=5)
        assert [c.message.content for c in out.choices] == [c.message.content for c in again.choices]  # seeded
        too_many = httpx.post(f"{server.url}/v1/chat/completions", timeout=10, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 4})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=10, json={
                "model": MODEL, "prompt": "the quick brown fox", "max_tokens": 24, "stream": True}) as response:
            next(response.iter_lines())  # the first chunk, then the client goes away
        server.wait_until(lambda health: health["running"] == 0, timeout=10)
        assert ask(server, "the quick brown fox", True)
        time.sleep(0.1)
        assert server.health()["running"] == 0


def test_a_request_that_fails_to_join_gets_500_and_the_engine_goes_on(tiny_model_dirs, monkeypatch):
    from specdraft.batch_engine import BatchedDecoder

    read = BatchedDecoder._read_chunk
    calls = []

    def fails_once(self, chunk):
        calls.append(chunk)
        if len(calls) == 1:
            raise RuntimeError("planted")
        return read(self, chunk)

    monkeypatch.setattr(BatchedDecoder, "_read_chunk", fails_once)
    with Live(make_app(tiny_model_dirs, max_batch=2)) as server:
        broken = httpx.post(f"{server.url}/v1/completions", timeout=10,
                            json={"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4})
        assert broken.status_code == 500 and broken.json()["error"]["code"] == "internal_error"
        assert ask(server, "the quick brown fox", True)
        assert server.health() == {"status": "ok", "queue_depth": 0, "running": 0}
