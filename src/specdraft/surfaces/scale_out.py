"""`specdraft serve --ray`: the server on Ray Serve, in replicas that each load the models once.

```
specdraft serve --ray --replicas 2 --threads 1                    # a local Ray cluster, two replica processes
specdraft serve --ray --min-replicas 1 --max-replicas 4           # autoscaled by ongoing requests per replica
specdraft serve --ray --ray-address HEAD_IP:6379 --replicas 4     # a cluster made with `ray start --head` / `--address`
```

Each replica builds the very app `specdraft serve` builds (`server_app.build_app`, run by `serve.ingress` on the
replica as it starts), so the API, streaming, the playground, `/health`, `/metrics` (that replica's) and the API key
work as on one machine; Ray's HTTP proxy spreads the requests over the replicas. Each response names the replica
that answered it (`x-specdraft-replica`), and each replica mirrors its speculation figures into Ray's metrics
every `MIRROR_SECONDS` (`ray.serve.metrics`, labelled by deployment and replica), which Ray's Prometheus endpoint
exports for the whole cluster. A replica that dies is started again by Ray's controller; the requests it was
answering fail with a 5xx from the proxy (or a stream that ends without `[DONE]`), which a client may retry, and
the others go on. On shutdown each replica stops taking requests and finishes the running ones within the
server's `--shutdown-grace`.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.extras import require

APP_NAME = DEPLOYMENT = "specdraft"
REPLICA_HEADER = "x-specdraft-replica"
MIRROR_SECONDS = 2.0  # how often a replica copies its figures into Ray's metrics


def import_ray() -> tuple[Any, Any]:
    """(ray, ray.serve), or a SpecdraftError that says how to install them."""
    require("ray", "specdraft serve --ray", "ray")
    import ray
    from ray import serve

    return ray, serve


@dataclass(frozen=True)
class Scale:
    """How many replicas and how big: `replicas` of them, or autoscaling between `min_replicas` and `max_replicas`
    towards `target_ongoing` requests per replica; each replica runs `threads` CPU threads (and asks Ray for as
    many CPUs) and takes up to `max_ongoing` requests at once (its batch and queue: past them it answers 429). A
    replica being stopped has `drain_seconds` to finish its requests (the server's shutdown grace, and a margin)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing: float = 8.0
    threads: int = 1
    max_ongoing: int = 72
    drain_seconds: float = 15.0

    def __post_init__(self) -> None:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise SpecdraftError("Autoscaling takes both --min-replicas and --max-replicas; give both, or neither "
                                 "and --replicas N.")
        if self.autoscaling and not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise SpecdraftError(f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas}: need "
                                 "0 <= min <= max and max >= 1.")
        if self.replicas < 1 or self.threads < 1 or self.max_ongoing < 1:
            raise SpecdraftError("--replicas and --threads must be >= 1.")
        if self.target_ongoing <= 0:
            raise SpecdraftError(f"--target-ongoing must be > 0, got {self.target_ongoing}.")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def deployment_options(self) -> dict[str, Any]:
        """The options of `serve.deployment` this scale asks for."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing,
            "graceful_shutdown_timeout_s": self.drain_seconds,
            "ray_actor_options": {"num_cpus": self.threads,
                                  "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(self.threads)}}},
        }
        if self.autoscaling:
            options["autoscaling_config"] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": self.target_ongoing}
        else:
            options["num_replicas"] = self.replicas
        return options

    def describe(self) -> str:
        """For the start-up line: how many replicas, of how many threads."""
        count = (f"{self.min_replicas}-{self.max_replicas} replicas (autoscaled at {self.target_ongoing:g} ongoing "
                 "requests each)" if self.autoscaling else f"{self.replicas} replica{'s' * (self.replicas > 1)}")
        return f"{count}, {self.threads} thread{'s' * (self.threads > 1)} each"


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that made it (`REPLICA_HEADER`)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]}
            await send(message)

        return await self.app(scope, receive, named)


class MetricsMirror:
    """Copies a replica's `server.metrics.Metrics` figures into Ray's metrics every `interval` seconds, on a daemon
    thread: counts since start as Ray counters (`specdraft_*_total`), α, τ, queue depth and running requests as
    gauges; Ray labels each with the deployment and the replica."""

    def __init__(self, metrics, interval: float = MIRROR_SECONDS) -> None:
        from ray.serve import metrics as ray_metrics

        self.metrics, self.interval = metrics, interval
        self._counters, self._gauges, self._sent = {}, {}, {}
        for name in metrics.totals():
            described = f"specdraft's {name.replace('_', ' ')} on this replica"
            if name.endswith("_total"):
                self._counters[name] = ray_metrics.Counter(f"specdraft_{name.removesuffix('_total')}", described)
                self._sent[name] = 0.0
            else:
                self._gauges[name] = ray_metrics.Gauge(f"specdraft_{name}", described)
        self._thread = threading.Thread(target=self._run, name="specdraft-ray-metrics", daemon=True)

    def start(self) -> "MetricsMirror":
        self._thread.start()
        return self

    def mirror(self) -> None:
        """Send what changed since the last call."""
        for name, value in self.metrics.totals().items():
            if name in self._counters:
                if value > self._sent[name]:
                    self._counters[name].inc(value - self._sent[name])
                    self._sent[name] = value
            else:
                self._gauges[name].set(value)

    def _run(self) -> None:
        while True:
            self.mirror()
            time.sleep(self.interval)


class Replica:
    """One replica of the deployment: when Ray starts it, `threads` torch threads, then the app `specdraft serve`
    builds with these options, naming the replica in a header and mirroring its figures into Ray's metrics."""

    def __init__(self, app_options: dict[str, Any], threads: int) -> None:
        self.app_options, self.threads = app_options, threads

    def __serve_build_asgi_app__(self):  # Ray Serve calls it on the replica (`serve.ingress` with no app)
        import torch
        from ray import serve

        from specdraft.surfaces.server_app import build_app

        torch.set_num_threads(self.threads)
        app = build_app(**self.app_options)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_tag)
        MetricsMirror(app.state.metrics).start()
        return app


def application(app_options: dict[str, Any], scale: Scale):
    """The Ray Serve application: `scale`'s replicas of `Replica` over these `serve` options."""
    _, serve = import_ray()
    deployment = serve.deployment(serve.ingress()(Replica), name=DEPLOYMENT, **scale.deployment_options())
    return deployment.bind(app_options, scale.threads)


def check_port_free(port: int, option: str) -> None:
    """A SpecdraftError naming `option` when `port` is taken (Ray's own error is a start-up timeout)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            raise SpecdraftError(f"Port {port} is in use: a Ray cluster stopped in the last minute keeps its agents "
                                 f"on it for up to a minute. Wait, or pass another {option}.") from None


def run(app_options: dict[str, Any], scale: Scale, host: str, port: int, address: str | None,
        metrics_port: int | None = None, ready=None) -> None:
    """Deploy on Ray Serve (a local cluster started here, or the one at `address`), call `ready()` once every replica
    answers, and serve until interrupted (Ctrl-C, SIGINT or SIGTERM); then the application is deleted (its replicas
    drain) and a local cluster stops. A replica that fails to start (a model that does not load) is a SpecdraftError
    with Ray's reason."""
    ray, serve = import_ray()
    init: dict[str, Any] = {"address": address, "namespace": APP_NAME}
    if address is None and metrics_port is not None:
        check_port_free(metrics_port, "--ray-metrics-port")
        init["_metrics_export_port"] = metrics_port
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):  # a service manager stops with SIGTERM; a background job may
        signal.signal(number, lambda *_: stop.set())  # have SIGINT ignored
    ray.init(**init)
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(application(app_options, scale), name=APP_NAME, route_prefix="/")
        except RuntimeError as error:
            raise SpecdraftError(f"The replicas did not start: {error}") from None
        if ready is not None:
            ready()
        while not stop.wait(1.0):
            pass
    finally:
        serve.delete(APP_NAME)
        ray.shutdown()
