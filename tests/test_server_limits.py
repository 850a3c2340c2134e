"""Serving limits, seeds and tenants: a request's k is capped, the memories kept are bounded, unseeded requests draw
their seeds from the OS (and report them), and `cache_salt` / `--cross-request-memory` partition what the server
remembers across requests."""

from __future__ import annotations

import httpx
import pytest

from live_server import Live, make_app
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.prefix_cache import PrefixCache
from specdraft.surfaces.server_app import check_speculation

MODEL = "target"
SAMPLED = {"model": MODEL, "prompt": "The quick", "max_tokens": 12, "temperature": 1.5, "n": 3}


def complete(server: Live, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)


# ---- serving limits -------------------------------------------------------------------------------------


def test_a_fixed_k_past_the_servers_max_k_gets_400_naming_the_field_and_the_option(tiny_model_dirs):
    with Live(make_app(tiny_model_dirs, max_k=6)) as server:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["specdraft"]["max_k"] == 6
        for k in (7, 100_000):
            refused = complete(server, {**SAMPLED, "speculative": {"drafter": "ngram", "k": k}})
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == "speculative.k", refused.text
            assert "at most 6" in error["message"] and "--max-k" in error["message"]
        for k in (6, "auto"):
            answered = complete(server, {**SAMPLED, "speculative": {"drafter": "ngram", "k": k}})
            assert answered.status_code == 200 and answered.json()["usage"]["k"] == k
    with pytest.raises(SpecdraftError, match="--k 40 is above --max-k 32"):  # the server's own default, at start
        check_speculation("40", 0, 4, {})


def test_the_trained_weights_load_once_and_the_memories_kept_are_bounded(tiny_model_dirs, eagle_file, monkeypatch):
    """50 requests with distinct k (one at a time) load the EAGLE weights once for all of them (each decoder re-read
    and re-packed them once); requests of ever new cache salts leave at most `max_memories` memories of earlier
    requests (a `suffix` corpus each) kept."""
    import specdraft.drafters as drafters

    loads, load = [], drafters._trained
    monkeypatch.setattr(drafters, "_trained", lambda *args: loads.append(args[0]) or load(*args))
    app = make_app(tiny_model_dirs, drafter="eagle", trained=str(eagle_file), draft=None, max_batch=1, max_k=64)
    with Live(app) as server:
        for k in range(1, 51):
            answered = complete(server, {**SAMPLED, "n": 1, "max_tokens": 2, "speculative": {"k": k}})
            assert answered.status_code == 200 and answered.json()["usage"]["k"] == k
    assert loads == ["eagle"]
    app = make_app(tiny_model_dirs, drafter="suffix", max_batch=1)
    pool = app.state.worker.pool
    with Live(app) as server:
        for salt in range(pool.max_memories + 4):
            assert complete(server, {**SAMPLED, "n": 1, "max_tokens": 2, "cache_salt": str(salt)}).status_code == 200
    kept = [salt.rsplit(":", 1)[-1] for salt in pool.memories]  # the tenant's part (all share here), the salt
    assert kept == [str(salt) for salt in range(4, pool.max_memories + 4)]  # the least recently used left


def test_stop_strings_are_bounded_in_count_and_length(live_single):
    for stop, says in ((["a", "b", "c", "d", "e"], "At most 4 stop strings"), ("x" * 257, "at most 256 characters")):
        refused = complete(live_single, {**SAMPLED, "stop": stop})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
        assert says in refused.json()["error"]["message"]
    assert complete(live_single, {**SAMPLED, "stop": "x" * 256}).status_code == 200


# ---- seeds ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_single(tiny_model_dirs):
    with Live(make_app(tiny_model_dirs)) as server:
        yield server


def samples(server: Live, body: dict) -> tuple[int, list[str]]:
    """The seed a response reports and its choices' texts."""
    answer = complete(server, body).json()
    return answer["seed"], [choice["text"] for choice in answer["choices"]]


def test_unseeded_requests_sample_anew_on_every_server_and_report_the_seed_that_samples_them_again(tiny_model_dirs):
    """Two unseeded requests to a fresh server, and the first one to each of two replicas, sample differently (their
    seeds came from `random.Random(0)` before: every restart and replica gave its i-th request the same sample); the
    seed a response reports, sent back to a restarted server, gives the same sample; `--seed` keeps one sequence."""
    replicas = []
    for _ in range(2):
        with Live(make_app(tiny_model_dirs)) as server:
            replicas.append([samples(server, SAMPLED) for _ in range(2)])
            chunks = httpx.post(f"{server.url}/v1/completions", json={**SAMPLED, "stream": True}, timeout=30).text
            seeds = {line for line in chunks.splitlines() if line.startswith("data: {")}
            assert seeds and all('"seed": ' in line for line in seeds)  # every chunk reports it
    (first, second), (other_first, _) = replicas
    assert first[0] != second[0] and first[1] != second[1]
    assert first[0] != other_first[0] and first[1] != other_first[1]
    with Live(make_app(tiny_model_dirs)) as restarted:
        assert samples(restarted, {**SAMPLED, "seed": first[0]}) == first
    fixed = []
    for _ in range(2):
        with Live(make_app(tiny_model_dirs, seed=7)) as server:
            fixed.append(samples(server, SAMPLED))
    assert fixed[0] == fixed[1]


# ---- cross-request memory -------------------------------------------------------------------------------


def cached(server: Live, salt: str | None = None, key: str | None = None) -> int:
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 2, "temperature": 0.0,
            "speculative": {"drafter": "none"}, **({"cache_salt": salt} if salt else {})}
    return complete(server, body, key).json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("memory", ["shared", "key"])
def test_cache_salts_and_api_keys_partition_the_prefix_cache(tiny_model_dirs, memory):
    """A prompt reuses the rows only of prompts sent with its `cache_salt` (and with `key`, its API key): another
    client learns nothing from `cached_tokens`. (The float32 tiny target keeps none by itself: one is put in.)"""
    app = make_app(tiny_model_dirs, max_batch=2, api_key="k1,k2", cross_request_memory=memory)
    app.state.worker.batch.prefixes = PrefixCache(1 << 20)
    with Live(app) as server:
        read = cached(server, key="k1") + cached(server, key="k1")  # the first reads all, the second all but one
        assert read > 0
        assert [cached(server, "a", "k1"), cached(server, "a", "k1"), cached(server, "b", "k1")] == [0, read, 0]
        assert cached(server, key="k2") == (read if memory == "shared" else 0)
        assert cached(server, "a", "k2") == (read if memory == "shared" else 0)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert complete(server, {**SAMPLED, "cache_salt": "a"}, "k3").status_code == 401


def suffix_corpora(pool) -> dict[str, int]:
    """The earlier requests the `suffix` drafters remember, by cache salt."""
    return {salt: len(memory["suffix"].requests) for salt, memory in pool.memories.items()}


def test_the_suffix_drafters_memory_is_partitioned_by_salt_and_key_or_off(tiny_model_dirs, monkeypatch):
    """The `suffix` drafters keep one corpus across requests per cache salt (and with `key`, per API key), none with
    `off`, where no prefix cache is kept either; one request at a time as in a batch."""
    body = {"model": MODEL, "prompt": "one two three four", "max_tokens": 4, "temperature": 0.0,
            "speculative": {"drafter": "suffix"}}
    corpora = {}
    for max_batch in (1, 4):
        for memory in ("shared", "key", "off"):
            app = make_app(tiny_model_dirs, max_batch=max_batch, api_key="k1,k2", cross_request_memory=memory)
            with Live(app) as server:
                for salt, key in ((None, "k1"), (None, "k2"), ("a", "k1"), ("a", "k1")):
                    assert complete(server, {**body, **({"cache_salt": salt} if salt else {})}, key).status_code == 200
            corpora[memory] = sorted(suffix_corpora(app.state.worker.pool).values())
        assert corpora == {"shared": [2, 2], "key": [1, 1, 2], "off": []}, max_batch

    monkeypatch.setattr(CausalLM, "reads_split_exactly", property(lambda self: True))  # where a cache would be kept
    for max_batch in (1, 2):
        for memory, kept in (("shared", True), ("off", False)):
            app = make_app(tiny_model_dirs, max_batch=max_batch, cross_request_memory=memory)
            assert (app.state.worker.batch.prefixes is not None) == kept, (max_batch, memory)


def test_a_bad_memory_mode_or_an_empty_key_list_fails_before_loading(tiny_model_dirs):
    with pytest.raises(SpecdraftError, match="--cross-request-memory must be one of shared, key, off"):
        make_app(tiny_model_dirs, cross_request_memory="tenant", target="/nonexistent")
    with pytest.raises(SpecdraftError, match="--api-key holds no key"):
        make_app(tiny_model_dirs, api_key=" , ", target="/nonexistent")
