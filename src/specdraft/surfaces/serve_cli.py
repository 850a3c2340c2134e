"""`specdraft serve`: the OpenAI-compatible server, with the model and speculation options of `generate`."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape  # a message's own [brackets] (pip install 'x[extra]') are no markup

from specdraft.batch_engine import DEFAULT_MAX_BATCH, megabytes
from specdraft.errors import SpecdraftError
from specdraft.extras import require
from specdraft.policy import GPU_MAX_AUTO_K
from specdraft.surfaces.model_setup import flag_names, with_options_of
from specdraft.surfaces.server_app import build_app, check_speculation

err = Console(stderr=True, soft_wrap=True)

# The options of `specdraft generate` that `serve` takes as they are (declared once, in cli.generate), besides
# the drafters' own (declared once, in the registry: `model_setup.with_drafter_flags`).
SHARED_OPTIONS = ("target", "draft", "drafter", "k", "tree_budget", "tree_branch", "draft_quant", "draft_vocab",
                  "dtype", "device", "gguf_weights", "context")


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default; 0.0.0.0 exposes the server)."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDRAFT_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on everything but /health and /; "
                                               "several keys separated by commas (one per client, e.g. with "
                                               "--cross-request-memory key)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The model id clients send (default: the target's name)."),
    max_queue: int = typer.Option(64, "--max-queue", min=1, help="Requests that may wait for the engine; more get 429."),
    request_timeout: float = typer.Option(600.0, "--request-timeout",
                                          help="Seconds a request may take, waiting included (then 504 / an error event)."),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Token budget of requests that set none."),
    shutdown_grace: float = typer.Option(10.0, "--shutdown-grace",
                                         help="On shutdown, seconds the running generation may take to finish."),
    seed: Optional[int] = typer.Option(
        None, help="Seeds the seeds of sampled requests that give none: the same sequence every start and replica. "
                   "Default: each drawn from the OS (every response reports its seed, to sample it again)."),
    max_k: int = typer.Option(
        GPU_MAX_AUTO_K, "--max-k", min=1,
        help="The largest fixed k a request may ask for (speculative.k; past it, 400): what one pass can use (on a "
             "GPU a pass of 33 tokens costs about one token's)."),
    cross_request_memory: str = typer.Option(
        "shared", "--cross-request-memory",
        help="Who shares what the server remembers across requests (the prefix cache, the suffix drafter's "
             "corpus), which cached_tokens and the tokens' kinds let a client probe: shared (every request), key "
             "(requests with the same API key) or off (nobody). A request's cache_salt partitions it further."),
    max_batch: int = typer.Option(
        DEFAULT_MAX_BATCH, "--max-batch", min=1,
        help="Sequences that generate together, each step one target pass over all (continuous batching; every "
             "drafter, chains and trees). 1: one request at a time."),
    kv_budget_mb: Optional[float] = typer.Option(
        None, "--kv-budget-mb", min=0.0,
        help="MiB of KV cache the batch's sequences may reserve together (each its prompt + "
             "max_tokens); a request that does not fit waits, one that never fits gets 400. Default: half the "
             "memory free once the models are loaded; 0: no limit."),
    prefix_cache_mb: float = typer.Option(
        256.0, "--prefix-cache-mb", min=0.0,
        help="MiB of cached rows of prompts read before, so a prompt that begins like one (a system prompt, earlier "
             "turns) reads only the rest; exact (the same bits as reading it), kept only where the kernels compute "
             "each token alone (packed GGUF models on the CPU, not AMX). 0: none."),
    max_body_mb: float = typer.Option(2.0, "--max-body-mb", min=0.001,
                                      help="Largest request body taken, in MiB (2: 64 bytes a token of a 32k context); "
                                           "a larger one gets 413 before it is read."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                          help="CPU threads (with --ray: of each replica, default 1; else torch's)."),
    ray: bool = typer.Option(False, "--ray", help="Serve on Ray Serve, in replicas that each load the models once "
                             "(needs the `ray` extra; docs/scale-out.md)."),
    replicas: int = typer.Option(1, "--replicas", min=1, help="With --ray: how many replicas."),
    min_replicas: Optional[int] = typer.Option(None, "--min-replicas", min=0,
                                               help="With --ray: autoscale from this many replicas (with --max-replicas)."),
    max_replicas: Optional[int] = typer.Option(None, "--max-replicas", min=1,
                                               help="With --ray: autoscale up to this many replicas."),
    target_ongoing: Optional[float] = typer.Option(
        None, "--target-ongoing", help="With --ray and autoscaling: ongoing requests per replica Ray aims at "
                                       "(default: --max-batch)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                              help="With --ray: join this Ray cluster (HOST:PORT of `ray start --head`; "
                                                   "default: start a local one)."),
    ray_metrics_port: int = typer.Option(8080, "--ray-metrics-port", min=0, max=65535,
                                         help="With --ray and a local cluster: the port of Ray's Prometheus metrics."),
    **model_options,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /reset_prefix_cache and a
    playground at /."""
    options = dict(api_key=api_key, served_model_name=served_model_name, max_queue=max_queue,
                   request_timeout=request_timeout, max_tokens=max_tokens, shutdown_grace=shutdown_grace, seed=seed,
                   max_body_mb=max_body_mb, max_batch=max_batch, kv_budget_mb=kv_budget_mb,
                   prefix_cache_mb=prefix_cache_mb, max_k=max_k, cross_request_memory=cross_request_memory,
                   **model_options)
    try:
        require("server", "specdraft serve", "fastapi", "uvicorn", "pydantic")
        if ray:
            return serve_on_ray(options, host, port, threads, replicas, min_replicas, max_replicas, target_ongoing,
                                ray_address, ray_metrics_port)
        if threads:
            import torch

            torch.set_num_threads(threads)
        app = build_app(**options)
    except SpecdraftError as error:
        err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
        raise typer.Exit(2)
    import uvicorn

    settings = app.state.settings
    err.print(f"serving {settings.served_model} on http://{host}:{port} (playground at /)", highlight=False)
    batching = f"batching up to {settings.max_batch} sequences" if settings.max_batch > 1 else "one request at a time"
    room = "no KV budget" if settings.kv_budget is None else f"a KV budget of {megabytes(settings.kv_budget)}"
    err.print(f"{batching}, {room}", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_grace)


DRAIN_MARGIN_SECONDS = 5.0  # Ray waits this long past --shutdown-grace before it kills a replica being stopped


def serve_on_ray(options: dict, host: str, port: int, threads: int | None, replicas: int, min_replicas: int | None,
                 max_replicas: int | None, target_ongoing: float | None, address: str | None,
                 metrics_port: int) -> None:
    """`serve --ray`: check the options here, then deploy the app on Ray Serve (`scale_out`) until interrupted."""
    from specdraft.surfaces import scale_out

    scale_out.import_ray()  # a clear error before anything starts
    scale = scale_out.Scale(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                            target_ongoing=target_ongoing or options["max_batch"], threads=threads or 1,
                            max_ongoing=options["max_batch"] + options["max_queue"],
                            drain_seconds=options["shutdown_grace"] + DRAIN_MARGIN_SECONDS)
    check_speculation(options["k"], options["tree_budget"], options["tree_branch"],
                      {name: options[name] for name in flag_names()}, options["max_k"])
    from specdraft.server import ServerSettings  # its checks of the keys and --cross-request-memory, before Ray starts

    ServerSettings(served_model="", api_key=options["api_key"], cross_request_memory=options["cross_request_memory"])
    err.print(f"starting {scale.describe()} on Ray Serve", highlight=False)
    metrics = "" if address else f"; Ray's metrics on http://127.0.0.1:{metrics_port}/metrics"
    scale_out.run(options, scale, host, port, address, metrics_port, ready=lambda: err.print(
        f"serving on http://{host}:{port} (playground at /){metrics}", highlight=False))


def with_generate_options(generate):
    """`serve` taking, besides its own options, those of `generate` named in SHARED_OPTIONS (for typer)."""
    return with_options_of(serve, generate, [*SHARED_OPTIONS, *flag_names()])
