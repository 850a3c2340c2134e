"""The server with continuous batching (`--max-batch`): concurrent clients get what they get one at a time,
streamed or not, with `n`, logprobs and disconnects, and the engine keeps serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import Live, make_app
from specdraft.prefix_cache import PrefixCache


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
@pytest.mark.alone
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

    def fails_once(self, joining, chunk):
        calls.append(chunk)
        if len(calls) == 1:
            raise RuntimeError("planted")
        return read(self, joining, chunk)

    monkeypatch.setattr(BatchedDecoder, "_read_chunk", fails_once)
    with Live(make_app(tiny_model_dirs, max_batch=2)) as server:
        broken = httpx.post(f"{server.url}/v1/completions", timeout=10,
                            json={"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4})
        assert broken.status_code == 500 and broken.json()["error"]["code"] == "internal_error"
        assert ask(server, "the quick brown fox", True)
        assert server.health() == {"status": "ok", "queue_depth": 0, "running": 0}


def test_a_request_whose_step_fails_gets_500_naming_it_and_the_batch_goes_on(tiny_model_dirs, monkeypatch):
    """A drafter that raises at a step (every draft model's here, once its draft passes ran) fails its request alone:
    a 500 naming the error, while a request streaming beside it in the batch gets its answer alone, and a later one
    is served. Before, the error escaped the step and every request in the batch got a 500."""
    import json

    from specdraft.batch_engine import BatchedDecoder
    from specdraft.drafters.model import ModelDrafter

    propose, step = ModelDrafter.propose_steps, BatchedDecoder.step

    def raises(self, ctx, k):
        yield from propose(self, ctx, k)
        raise RuntimeError("planted draft fault")

    monkeypatch.setattr(ModelDrafter, "propose_steps", raises)
    monkeypatch.setattr(BatchedDecoder, "step", lambda self: (time.sleep(0.02), step(self))[1])  # so the two meet
    plain = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.0,
             "speculative": {"drafter": "none"}}
    app = make_app(tiny_model_dirs, max_batch=2)
    with Live(app) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={**plain, "stream": True}) as out:
            lines = out.iter_lines()
            streamed = [next(lines)]  # it runs
            broken = httpx.post(f"{server.url}/v1/completions", timeout=30,
                                json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8})  # the draft model's
            streamed += list(lines)
        assert broken.status_code == 500 and broken.json()["error"]["code"] == "internal_error"
        assert "RuntimeError: planted draft fault" in broken.json()["error"]["message"]
        assert app.state.worker.batch.largest_batch == 2  # they stepped together
        text = "".join(json.loads(line[len("data: "):])["choices"][0]["text"] for line in streamed
                       if line.startswith("data: {"))
        later = httpx.post(f"{server.url}/v1/completions", timeout=30, json=plain)
        assert later.status_code == 200 and text == later.json()["choices"][0]["text"] != ""
        server.wait_until(lambda health: health["running"] == 0 and health["queue_depth"] == 0)


def test_the_kv_budget_queues_what_does_not_fit_now_and_refuses_what_never_fits(tiny_model_dirs):
    app = make_app(tiny_model_dirs, max_batch=4, kv_budget_mb=0.5)
    batch = app.state.worker.batch
    assert batch.kv_budget == 1 << 19
    plain = {"speculative": {"drafter": "none"}}  # the target's cache alone: what the budget below is cut for

    def complete(server, max_tokens, n=1):
        return httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": max_tokens, "n": n, "temperature": 0.0, **plain})

    with Live(app) as server:
        prompt_tokens = complete(server, 1).json()["usage"]["prompt_tokens"]
        batch.kv_budget = (prompt_tokens + 8) * batch.target.kv_bytes_per_token  # one request of 8 tokens at a time
        too_long = complete(server, 9)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        assert "KV cache" in too_long.json()["error"]["message"]
        two_choices = complete(server, 8, n=2)
        assert two_choices.status_code == 400 and two_choices.json()["error"]["param"] == "n"
        with ThreadPoolExecutor(3) as pool:  # each waits for the one before to leave
            answers = list(pool.map(lambda _: complete(server, 8), range(3)))
        assert all(a.status_code == 200 for a in answers)
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f"specdraft_kv_cache_budget_bytes {batch.kv_budget}" in metrics
        assert "specdraft_kv_cache_reserved_bytes 0" in metrics
        assert batch.largest_batch == 1
        server.wait_until(lambda health: health["running"] == 0 and health["queue_depth"] == 0)


def test_the_kv_budget_option_defaults_to_half_the_free_memory_and_0_lifts_it(tiny_model_dirs):
    import torch

    from specdraft.batch_engine import default_kv_budget, free_memory_bytes

    assert make_app(tiny_model_dirs, max_batch=2, kv_budget_mb=0).state.worker.batch.kv_budget is None
    assert 0 < make_app(tiny_model_dirs, max_batch=2).state.worker.batch.kv_budget < free_memory_bytes(torch.device("cpu"))
    assert abs(default_kv_budget(torch.device("cpu")) / free_memory_bytes(torch.device("cpu")) - 0.5) < 0.1


def test_serving_batches_every_drafter_by_default(tiny_model_dirs, eagle_file):
    from specdraft.batch_engine import DEFAULT_MAX_BATCH
    from specdraft.server.worker import Worker

    for overrides in ({}, {"tree_budget": 6}, {"drafter": "eagle", "trained": str(eagle_file), "draft": None}):
        worker = make_app(tiny_model_dirs, **overrides).state.worker
        assert isinstance(worker, Worker) and worker.batch.max_batch == DEFAULT_MAX_BATCH
        assert worker.batch.tree_budget == overrides.get("tree_budget", 0)


@pytest.mark.parametrize("speculation", ["trees", "eagle"])
def test_trees_and_a_trained_drafter_in_a_batch_give_the_one_at_a_time_answers(tiny_model_dirs, one_at_a_time,
                                                                               eagle_file, speculation):
    overrides = ({"tree_budget": 6} if speculation == "trees" else
                 {"drafter": "eagle", "trained": str(eagle_file), "draft": None})
    app = make_app(tiny_model_dirs, max_batch=4, **overrides)
    with Live(app) as server:
        jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda job: ask(server, *job), jobs))
        for (prompt, _), answer in zip(jobs, answers):
            assert answer == one_at_a_time[(prompt, "none")], prompt
        metrics = httpx.get(f"{server.url}/metrics").text
        drafted = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("specdraft_batch_draft_tokens_sum")]
        assert drafted and drafted[0] > 0 and 'status="500"' not in metrics
    assert len(app.state.worker.pool._shared) == (speculation == "eagle")  # its weights loaded once for all


def test_a_batched_server_on_the_gpus_static_cache_gives_its_one_at_a_time_answers(tiny_model_dirs, monkeypatch):
    """The GPU's path, run eagerly on the CPU (`SPECDRAFT_STATIC_CACHE=1`): a batched server's target, prompt
    reader and packed draft caches on static caches. On a GPU every batched request was refused before (400:
    "the static one is not supported"), and `serve` batches by default."""
    monkeypatch.setenv("SPECDRAFT_STATIC_CACHE", "1")
    jobs = [(p, stream, d) for p in PROMPTS[:4] for stream in (False, True) for d in (None, "ngram")]
    with Live(make_app(tiny_model_dirs)) as server:  # one at a time
        alone = {(p, d): ask(server, p, False, d) for p, _, d in jobs}
    with Live(make_app(tiny_model_dirs, max_batch=4)) as server:
        assert server.app.state.worker.batch.target.static and server.app.state.worker.batch._reader.static
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda job: ask(server, *job), jobs))
        assert answers == [alone[(p, d)] for p, _, d in jobs]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'status="500"' not in metrics
        server.wait_until(lambda health: health["running"] == 0 and health["queue_depth"] == 0)


def test_a_prompt_that_begins_like_an_earlier_one_reports_its_cached_tokens_until_a_reset(tiny_model_dirs):
    """usage.prompt_tokens_details.cached_tokens and /metrics count the prompt tokens taken from the prefix cache;
    POST /reset_prefix_cache forgets the kept prompts (the float32 tiny target keeps none by itself: its wide passes
    are not split-exact, so one is put in to follow the counts)."""
    app = make_app(tiny_model_dirs, max_batch=2)
    batch = app.state.worker.batch
    assert batch.prefixes is None
    batch.prefixes = PrefixCache(1 << 20)
    plain = {"speculative": {"drafter": "none"}}

    def usage(server, n: int = 1) -> dict:
        return httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0, "n": n, **plain}).json()["usage"]

    with Live(app) as server:
        first, second = usage(server), usage(server)
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["prompt_tokens_details"] == {"cached_tokens": first["prompt_tokens"] - 1}  # all but the last
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f"specdraft_prompt_tokens_cached_total {first['prompt_tokens'] - 1}" in metrics
        assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"cleared": True}
        assert usage(server)["prompt_tokens_details"] == {"cached_tokens": 0}
        # n choices each read the prompt but its last token, the second from the first's rows: the request read
        # it once (none cached); asked again, only each choice's last token (n of them)
        httpx.post(f"{server.url}/reset_prefix_cache")
        assert usage(server, n=2)["prompt_tokens_details"] == {"cached_tokens": 0}
        assert usage(server, n=2)["prompt_tokens_details"] == {"cached_tokens": first["prompt_tokens"] - 2}
    with Live(make_app(tiny_model_dirs, max_batch=1)) as server:  # none kept: the float32 target is not split-exact
        assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"cleared": False}
