"""`specdraft serve --ray` (`surfaces.scale_out`): options checked before anything starts, and on a local Ray cluster
(slow) the server's API through Ray's proxy, requests spread over two replicas, their figures in Ray's metrics by
replica, and a replica killed mid-load."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import make_app

from specdraft.errors import SpecdraftError
from specdraft.surfaces.scale_out import REPLICA_HEADER, ReplicaHeader, Scale, import_ray



def test_a_scale_is_checked_and_turned_into_deployment_options():
    fixed = Scale(replicas=2, threads=1, max_ongoing=72, drain_seconds=12.5).deployment_options()
    assert fixed["num_replicas"] == 2 and fixed["max_ongoing_requests"] == 72 and "autoscaling_config" not in fixed
    assert fixed["graceful_shutdown_timeout_s"] == 12.5
    assert fixed["ray_actor_options"] == {"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    auto = Scale(min_replicas=1, max_replicas=4, target_ongoing=8, threads=2).deployment_options()
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    assert "num_replicas" not in auto and auto["ray_actor_options"]["num_cpus"] == 2
    for bad, flag in (({"min_replicas": 1}, "--max-replicas"), ({"min_replicas": 3, "max_replicas": 2}, "--min"),
                      ({"replicas": 0}, "--replicas"), ({"target_ongoing": 0}, "--target-ongoing")):
        with pytest.raises(SpecdraftError, match=flag):
            Scale(**bad)


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SpecdraftError, match=r"pip install -e '\.\[ray\]'"):
        import_ray()


def test_serve_with_ray_checks_its_options_then_deploys_them(tiny_model_dirs, monkeypatch):
    from typer.testing import CliRunner

    from specdraft.surfaces import scale_out
    from specdraft.surfaces.cli import app

    monkeypatch.setattr(scale_out, "import_ray", lambda: (None, None))
    monkeypatch.setattr(scale_out, "run", lambda *args, **kw: pytest.fail("deployed despite a bad option"))
    target = ["--target", str(tiny_model_dirs["target"]), "--draft", str(tiny_model_dirs["draft"])]
    for bad, says in ((["--tree-budget", "-1"], "tree-budget"), (["--min-replicas", "2"], "--max-replicas"),
                      (["--k", "zero"], "--k")):
        result = CliRunner().invoke(app, ["serve", "--ray", *target, *bad])
        assert result.exit_code == 2 and says in result.output, result.output
    deployed = []
    monkeypatch.setattr(scale_out, "run", lambda options, scale, *rest, **kw: deployed.append((options, scale)))
    result = CliRunner().invoke(app, ["serve", "--ray", *target, "--replicas", "3", "--threads", "2",
                                      "--max-batch", "4", "--max-queue", "10", "--shutdown-grace", "7"])
    assert result.exit_code == 0, result.output
    [(options, scale)] = deployed  # the server's options go to every replica; the scale follows them
    assert options["max_batch"] == 4 and options["target"] == str(tiny_model_dirs["target"])
    assert (scale.replicas, scale.threads, scale.max_ongoing, scale.drain_seconds) == (3, 2, 14, 12.0)


def test_a_taken_metrics_port_is_refused_with_the_option_to_change():
    from specdraft.surfaces.scale_out import check_port_free

    with socket.socket() as taken:
        taken.bind(("", 0))
        with pytest.raises(SpecdraftError, match="--ray-metrics-port"):
            check_port_free(taken.getsockname()[1], "--ray-metrics-port")


def test_the_replica_header_names_the_replica_on_every_response(tiny_model_dirs):
    from fastapi.testclient import TestClient

    app = make_app(tiny_model_dirs, max_batch=1)
    app.add_middleware(ReplicaHeader, replica="r-7")
    with TestClient(app) as client:
        assert client.get("/health").headers[REPLICA_HEADER] == "r-7"
        assert client.get("/nowhere").headers[REPLICA_HEADER] == "r-7"


# ---- a local Ray cluster ------------------------------------------------------------------------------------------

KEY = "sesame"  # the cluster's API key


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    """Two replicas of the tiny pair on a local Ray cluster, behind Ray's proxy on a free loopback port."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from specdraft.surfaces.scale_out import APP_NAME, application

    metrics_port, http_port = free_port(), free_port()
    ray.init(num_cpus=4, include_dashboard=False, _metrics_export_port=metrics_port, namespace="specdraft-test",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        options = dict(api_key=KEY, served_model_name="tiny", max_queue=64, request_timeout=60.0, max_tokens=16,
                       shutdown_grace=2.0, seed=0, max_body_mb=2.0, max_batch=4, kv_budget_mb=None,
                       target=str(tiny_model_dirs["target"]), draft=str(tiny_model_dirs["draft"]), drafter="model",
                       k="3", tree_budget=0, tree_branch=4, draft_quant="none", draft_vocab=0, dtype="float32",
                       device="cpu", gguf_weights="auto", draft_confidence=None, ngram_max=None, ngram_min=None,
                       suffix_min_match=None, suffix_min_score=None, suffix_factor=None, exit_layer=None,
                       trained=None)
        serve.run(application(options, Scale(replicas=2, threads=1, max_ongoing=68)), name=APP_NAME,
                  route_prefix="/", blocking=False)
        yield {"url": f"http://127.0.0.1:{http_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(url: str, prompt: str, stream: bool, timeout: float = 60.0, max_tokens: int = 12) -> tuple[str, str | None]:
    """(the answer, the replica that gave it) through the openai client."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=timeout, max_retries=0)
    call = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
        stream=stream)
    replica = call.headers.get(REPLICA_HEADER)
    out = call.parse()
    if not stream:
        return out.choices[0].message.content, replica
    chunks = [chunk for chunk in out if chunk.choices]
    if not chunks or chunks[-1].choices[0].finish_reason is None:  # the stream ended before the answer did
        raise httpx.RemoteProtocolError("the stream ended without a finish_reason")
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks), replica


def replica_pids() -> list[int]:
    """The processes of this cluster's replicas (Ray names them `ray::ServeReplica:...`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if b"ServeReplica:specdraft" in handle.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.mark.slow
@pytest.mark.alone  # two Ray replicas and their clients
def test_the_api_through_ray_answers_from_both_replicas_as_one_server(cluster, tiny_model_dirs):
    from live_server import Live

    with Live(make_app(tiny_model_dirs, max_batch=1, served_model_name="tiny", api_key=KEY)) as alone:
        expected = {p: chat(alone.url, p, False)[0] for p in ("hello there", "the quick brown fox")}
    jobs = [(p, stream) for p in expected for stream in (False, True)] * 4
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: chat(cluster["url"], *job), jobs))
    assert all(text == expected[prompt] for (prompt, _), (text, _) in zip(jobs, answers))
    assert len({replica for _, replica in answers}) == 2  # spread over both
    assert httpx.get(f"{cluster['url']}/health").json()["status"] == "ok"  # as on one machine: health, the
    assert "<html" in httpx.get(f"{cluster['url']}/").text.lower()  # playground, the API key, the app's metrics
    assert httpx.get(f"{cluster['url']}/v1/models").status_code == 401
    assert "specdraft_generation_tokens_total" in httpx.get(f"{cluster['url']}/metrics",
                                                            headers={"Authorization": f"Bearer {KEY}"}).text
    deadline, seen = time.monotonic() + 60, set()
    while time.monotonic() < deadline and len(seen) < 2:  # each replica's figures, labelled by replica
        lines = httpx.get(cluster["metrics"]).text.splitlines()
        seen = {line.split('replica="')[1].split('"')[0] for line in lines
                if line.startswith("ray_specdraft_generation_tokens") and 'replica="' in line}
        time.sleep(2)
    assert len(seen) == 2


@pytest.mark.slow
@pytest.mark.alone  # two Ray replicas and their clients
def test_a_replica_killed_mid_load_fails_only_its_requests_and_ray_starts_another(cluster):
    """Eight clients send requests without pause; one replica's process is killed among them. Every request
    completes or ends with a retryable error (a 5xx, or a stream cut short), the other replica goes on answering,
    and Ray starts a new replica that answers too."""
    import threading

    import openai

    before = replica_pids()
    assert len(before) == 2
    outcomes: list[tuple[float, str]] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                chat(cluster["url"], f"client {i} asks about the sea", stream=i % 2 == 0, timeout=30, max_tokens=64)
                outcome = "ok"
            except openai.APIStatusError as error:
                outcome = f"status {error.status_code}"
            except (openai.APIConnectionError, httpx.HTTPError):  # a stream cut short by the dead replica
                outcome = "cut"
            outcomes.append((time.monotonic(), outcome))

    with ThreadPoolExecutor(8) as pool:
        for i in range(8):
            pool.submit(client, i)
        time.sleep(2.0)
        killed_at = time.monotonic()
        os.kill(before[0], signal.SIGKILL)
        time.sleep(3.0)
        stop.set()
    kinds = [outcome for _, outcome in outcomes]
    assert all(kind in ("ok", "cut") or kind.startswith("status 5") for kind in kinds), kinds
    assert sum(1 for at, kind in outcomes if at > killed_at + 1.0 and kind == "ok") >= 4  # the other went on
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray starts a new replica; both answer again
        pids = replica_pids()
        if len(pids) == 2 and before[0] not in pids:
            break
        time.sleep(1)
    assert len(replica_pids()) == 2 and before[0] not in replica_pids()
    replicas = set()
    while time.monotonic() < deadline and len(replicas) < 2:
        replicas.add(chat(cluster["url"], "hello there", False)[1])
    assert len(replicas) == 2


@pytest.mark.slow
@pytest.mark.alone  # two Ray replicas and their clients
def test_deleting_the_application_drains_a_request_in_flight(cluster):
    """Last in this module (it deletes the deployment): a stream that has begun when the application is deleted
    still ends with its finish_reason, as Ray stops routing to the replica and waits for its requests."""
    import threading

    import openai
    from ray import serve

    from specdraft.surfaces.scale_out import APP_NAME

    client = openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key=KEY, timeout=60, max_retries=0)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count on"}],
                                            max_tokens=96, temperature=0.0, stream=True)
    chunks = iter(stream)
    first = next(chunks)  # the request is running on a replica now
    deleting = threading.Thread(target=serve.delete, args=(APP_NAME,))
    deleting.start()
    rest = [chunk for chunk in chunks if chunk.choices]
    deleting.join(60)
    assert first is not None and rest and rest[-1].choices[0].finish_reason in ("length", "stop")
    assert not deleting.is_alive()
