"""`specdraft serve`: the OpenAI-compatible server, with the model and speculation options of `generate`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from specdraft.batch_engine import DEFAULT_MAX_BATCH, default_kv_budget, megabytes
from specdraft.errors import SpecdraftError
from specdraft.surfaces.model_setup import flag_names

err = Console(stderr=True, soft_wrap=True)

# The options of `specdraft generate` that `serve` takes as they are (declared once, in cli.generate), besides
# the drafters' own (declared once, in the registry: `model_setup.with_drafter_flags`).
SHARED_OPTIONS = ("target", "draft", "drafter", "k", "tree_budget", "tree_branch", "draft_quant", "draft_vocab",
                  "dtype", "device", "gguf_weights")


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default; 0.0.0.0 exposes the server)."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDRAFT_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on everything but /health and /."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="The model id clients send (default: the target's name)."),
    max_queue: int = typer.Option(64, "--max-queue", min=1, help="Requests that may wait for the engine; more get 429."),
    request_timeout: float = typer.Option(600.0, "--request-timeout",
                                          help="Seconds a request may take, waiting included (then 504 / an error event)."),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Token budget of requests that set none."),
    shutdown_grace: float = typer.Option(10.0, "--shutdown-grace",
                                         help="On shutdown, seconds the running generation may take to finish."),
    seed: int = typer.Option(0, help="Seeds the seeds of sampled requests that give none."),
    max_batch: int = typer.Option(
        DEFAULT_MAX_BATCH, "--max-batch", min=1,
        help="Sequences that generate together, each step one target pass over all (continuous batching; every "
             "drafter, chains and trees). 1: one request at a time."),
    kv_budget_mb: Optional[float] = typer.Option(
        None, "--kv-budget-mb", min=0.0,
        help="With --max-batch > 1: MiB of KV cache the batch's sequences may reserve together (each its prompt + "
             "max_tokens); a request that does not fit waits, one that never fits gets 400. Default: half the "
             "memory free once the models are loaded; 0: no limit."),
    max_body_mb: float = typer.Option(2.0, "--max-body-mb", min=0.001,
                                      help="Largest request body taken, in MiB (2: 64 bytes a token of a 32k context); "
                                           "a larger one gets 413 before it is read."),
    **model_options,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics and a playground at /."""
    try:
        app = build_app(api_key=api_key, served_model_name=served_model_name, max_queue=max_queue,
                        request_timeout=request_timeout, max_tokens=max_tokens, shutdown_grace=shutdown_grace,
                        seed=seed, max_body_mb=max_body_mb, max_batch=max_batch, kv_budget_mb=kv_budget_mb,
                        **model_options)
    except SpecdraftError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        raise typer.Exit(2)
    import uvicorn

    settings = app.state.settings
    err.print(f"serving {settings.served_model} on http://{host}:{port} (playground at /)", highlight=False)
    if settings.max_batch > 1:
        room = "no KV budget" if settings.kv_budget is None else f"a KV budget of {megabytes(settings.kv_budget)}"
        err.print(f"batching up to {settings.max_batch} sequences, {room}", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_grace)


def build_app(*, api_key, served_model_name, max_queue, request_timeout, max_tokens, shutdown_grace, seed,
              max_body_mb=2.0, max_batch=DEFAULT_MAX_BATCH, kv_budget_mb=None, target, draft, drafter, k, tree_budget, tree_branch, draft_quant,
              draft_vocab, dtype, device, gguf_weights, **flags):
    """Load the models as `generate` does and build the app (SpecdraftError for a bad option)."""
    from specdraft.engine import check_tree_options
    from specdraft.policy import make_policy
    from specdraft.server import DecoderPool, ServerSettings, create_app
    from specdraft.surfaces.model_setup import drafter_flags, load_models

    check_tree_options(tree_budget, tree_branch)  # bad options fail before any loading
    make_policy(k, tree_budget)
    options = drafter_flags(**flags)
    target_lm, draft_lm = load_models(target, draft, drafter, options, dtype=dtype, device=device,
                                      gguf_weights=gguf_weights, draft_quant=draft_quant, draft_vocab=draft_vocab)
    pool = DecoderPool(target_lm, draft_lm, drafter=drafter, k=k, options=options, tree_budget=tree_budget,
                       tree_branch=tree_branch)
    kv_budget = (default_kv_budget(target_lm.device) if kv_budget_mb is None
                 else int(kv_budget_mb * (1 << 20)) if kv_budget_mb > 0 else None)
    settings = ServerSettings(served_model=served_model_name or Path(target).name, api_key=api_key,
                              max_queue=max_queue, request_timeout=request_timeout, default_max_tokens=max_tokens,
                              shutdown_grace=shutdown_grace, seed=seed, max_body_bytes=int(max_body_mb * (1 << 20)),
                              max_batch=max_batch, kv_budget=kv_budget)
    return create_app(pool, settings)


def with_generate_options(generate):
    """`serve` taking, besides its own options, those of `generate` named in SHARED_OPTIONS (for typer)."""
    shared = inspect.signature(generate, eval_str=True).parameters
    own = [p for p in inspect.signature(serve, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = [*SHARED_OPTIONS, *flag_names()]
    serve.__signature__ = inspect.Signature([*own, *(shared[name].replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                                     for name in names)])
    return serve
