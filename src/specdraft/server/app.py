"""The FastAPI app: OpenAI-compatible routes, health, metrics, the playground, and API-key checks.

Every route handler is a module-level function that finds the server's parts on `request.app.state`:
`worker` (the queue and the engine thread; `worker.pool` holds the models), `metrics`, `settings`
(`ServerSettings`), `seeds` (draws the seed of a request that gives none), `keys` (the API keys, as bytes),
`started` (the creation time `/v1/models` reports) and `preparing` (the lock around the one tokenizer).
`create_app` builds those parts and wires the handlers to their routes.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import random
import threading
import time
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdraft.server.decoders import DecoderPool
from specdraft.server.errors import ApiError
from specdraft.server.metrics import Metrics
from specdraft.server.middleware import BodyLimit, RequestCounter
from specdraft.server.prepare import Generation, prepare
from specdraft.server.responses import ResponseShape, sse
from specdraft.server.schemas import ChatCompletionRequest, CompletionRequest
from specdraft.server.settings import CrossRequestMemory, ServerSettings
from specdraft.server.worker import Failed, Finished, Job, Step, Worker, timeout_error

# How often a request waiting for its results checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.25

RequestSchema = type[ChatCompletionRequest] | type[CompletionRequest]


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


# --- request bodies -------------------------------------------------------------------------------------------------

def _field_path(location) -> str:
    """`messages.0.content` from pydantic's location, without "body" and the union branches it tried (`str`, `int`, ...)."""
    parts = [str(part) for part in location if part != "body"]
    return ".".join(part for part in parts if not (part in ("str", "int", "float", "bool") or "[" in part))


def _validation_error(error: ValidationError) -> ApiError:
    """A 400 naming the first problem of a body that is not JSON or does not fit the schema."""
    first = error.errors()[0]
    field = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"The body is not valid JSON: {first.get('msg')}.", code="invalid_json")
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unsupported field {field!r}; remove it.", param=field, code="unsupported_parameter")
    if not field:
        return ApiError(400, f"The body must be a JSON object with the request's fields: {first.get('msg')}.",
                        code="invalid_body")
    return ApiError(400, f"Invalid {field}: {first.get('msg')}.", param=field, code="invalid_value")


# --- keys and memory partitions -------------------------------------------------------------------------------------

def bearer(request: Request) -> str | None:
    """The key the request sent ('Authorization: Bearer <key>'), if any."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def check_key(request: Request) -> None:
    """The dependency of every keyed route: a 401 unless the server is open or the request sent one of its keys."""
    keys = request.app.state.keys
    if not keys:
        return
    token = (bearer(request) or "").encode()
    if not sum(hmac.compare_digest(token, key) for key in keys):  # every key compared: no early exit
        raise ApiError(401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>'.",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def tenant(request: Request) -> str:
    """The part of the cross-request memory the request's client shares: with `key`, that of its API key (a
    digest: the key itself is kept nowhere); else everyone's ("")."""
    if request.app.state.settings.cross_request_memory != CrossRequestMemory.key:
        return ""
    return hashlib.sha256((bearer(request) or "").encode()).hexdigest()


# --- errors as OpenAI error JSON ------------------------------------------------------------------------------------

async def api_error(_request: Request, error: ApiError) -> JSONResponse:
    """A user's mistake (or a refusal: 429, 504, ...) as OpenAI error JSON."""
    return error.response()


async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Routing errors (404, 405) as OpenAI error JSON."""
    message = {404: "No such route; the API lives under /v1 (GET /v1/models).",
               405: "This route does not take that method."}.get(error.status_code, str(error.detail))
    return ApiError(error.status_code, message).response()


async def bug(_request: Request, _error: Exception) -> JSONResponse:
    """Anything else: a 500 that says it is a bug."""
    return ApiError(500, "The server failed on this request; this is a bug, please report it.",
                    code="internal_error").response()


# --- generating -----------------------------------------------------------------------------------------------------

async def next_result(job: Job, request: Request) -> Step | Finished | Failed:
    """The job's next result; cancels the job and raises ClientGone if the client disconnects meanwhile,
    and gives up (504) once the request is past its timeout, even while it still waits in the queue."""
    while True:
        try:
            return await asyncio.wait_for(job.results.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone from None
            if job.expired:
                job.cancel()
                return Failed(timeout_error(job.timeout))


async def stream(job: Job, shape: ResponseShape, first: Step | Finished | Failed):
    """The job's results as SSE events, from `first` to `[DONE]` (or an error event); the job is cancelled if the
    stream ends early (the client went away, the server is stopping)."""
    done = False
    try:
        item = first
        while True:
            if isinstance(item, Step):
                yield sse(shape.chunk(item))
            elif isinstance(item, Finished):
                if shape.generation.include_usage:
                    yield sse(shape.usage_chunk(item.stats))
                done = True
                yield sse("[DONE]")
                return
            else:  # an error after the stream began: OpenAI clients raise on an "error" event
                done = True
                yield sse(item.error.body())
                return
            item = await job.results.get()
    finally:
        if not done:  # the client went away (or the server is stopping): stop the engine at its next step
            job.cancel()


async def generate(generation: Generation, request: Request) -> Response:
    """Queue `generation` on the worker and answer with its result: one JSON body, or an SSE stream."""
    worker = request.app.state.worker
    job = worker.submit(generation, asyncio.get_running_loop())
    shape = ResponseShape(generation, worker.pool.target.tokenizer)
    try:
        item = await next_result(job, request)
        if isinstance(item, Failed):
            return item.error.response()
        if generation.stream:
            return StreamingResponse(stream(job, shape, item), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        steps = []
        while isinstance(item, Step):
            steps.append(item)
            item = await next_result(job, request)
        if isinstance(item, Failed):
            return item.error.response()
        return JSONResponse(shape.complete(steps, item.stats))
    except ClientGone:
        return Response(status_code=499)
    except asyncio.CancelledError:  # uvicorn gave up on this request (shutdown)
        job.cancel()
        raise


def checked(state, schema: RequestSchema, body: bytes, part: str) -> Generation:
    """The request in `body`, parsed, validated and tokenized (ApiError 4xx where it is wrong); `state`: the app's
    state; `part`: its `tenant`."""
    try:
        parsed = schema.model_validate_json(body)
    except ValidationError as error:
        raise _validation_error(error) from None
    with state.preparing:
        state.worker.check_room()  # the queue may have filled while this request waited for the tokenizer
        settings = state.settings
        return prepare(parsed, state.worker.pool, settings.served_model, settings.default_max_tokens, state.seeds,
                       part)


async def answer(schema: RequestSchema, request: Request) -> Response:
    """A completion request answered: room checked, body prepared off the event loop, then generated."""
    state = request.app.state
    state.worker.check_room()  # a full queue answers 429 before the body is read, parsed and tokenized
    # Parsing and tokenizing a long prompt takes seconds: off the event loop, which keeps answering meanwhile.
    generation = await asyncio.to_thread(checked, state, schema, await request.body(), tenant(request))
    return await generate(generation, request)


# --- routes ---------------------------------------------------------------------------------------------------------

async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions over the model's chat template (streamed as SSE with `stream: true`);
    the body is a `ChatCompletionRequest`."""
    return await answer(ChatCompletionRequest, request)


async def completions(request: Request) -> Response:
    """OpenAI text completions of a raw prompt (text or token ids); the body is a `CompletionRequest`."""
    return await answer(CompletionRequest, request)


async def models(request: Request) -> dict:
    """The one served model, with the drafters a request may ask for, the server's defaults and the largest
    fixed k it takes."""
    state = request.app.state
    pool = state.worker.pool
    default = pool.default
    return {"object": "list", "data": [{
        "id": state.settings.served_model, "object": "model", "created": state.started, "owned_by": "specdraft",
        "max_context": pool.target.max_context,
        "specdraft": {"drafters": pool.drafters(), "default": {"drafter": default.drafter, "k": default.k},
                      "max_k": pool.max_k},
    }]}


async def health(request: Request) -> dict:
    """Liveness, open without a key: the queue and whether the engine is busy."""
    worker = request.app.state.worker
    return {"status": "ok", "queue_depth": worker.queue_depth, "running": worker.running}


async def reset_prefix_cache(request: Request) -> dict:
    """Forget the prompts kept for their prefixes, so the next prompts are read whole (a benchmark's cold
    start); `cleared` is false where the server keeps none (not exact here, or --prefix-cache-mb 0)."""
    worker = request.app.state.worker
    prefixes = worker.batch.prefixes
    if prefixes is not None:
        prefixes.clear()
    return {"cleared": prefixes is not None}


async def prometheus(request: Request) -> PlainTextResponse:
    """Prometheus text: requests, tokens, α, τ, acceptance per draft position, time per token, queue."""
    return PlainTextResponse(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")


async def playground() -> HTMLResponse:
    """The playground page (open: it holds no data; its API calls send the key typed into it)."""
    return HTMLResponse(resources.files("specdraft.server").joinpath("static/playground.html").read_text())


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine thread runs while the app does; on shutdown it gets `shutdown_grace` seconds to finish. The objects
    alive once the models are loaded (torch's, transformers', the tokenizer's: hundreds of thousands) are frozen out of
    the garbage collector's sight, so a full collection walks only what requests made: unfrozen, one stalled every
    stream and /health for 0.4-0.9 s. They are handed back on shutdown (frozen at exit, nanobind's objects reported
    themselves leaked)."""
    gc.collect()
    gc.freeze()
    app.state.worker.start()
    yield
    await asyncio.to_thread(app.state.worker.stop, app.state.settings.shutdown_grace)
    gc.unfreeze()


# --- wiring ---------------------------------------------------------------------------------------------------------

def _engine(pool: DecoderPool, settings: ServerSettings) -> tuple[Worker, Metrics]:
    """The worker that runs `pool`'s requests (batching up to `settings.max_batch` sequences) and the metrics that
    watch it."""
    prefix_cache_bytes = settings.prefix_cache_bytes if settings.remembers else 0
    pool.remember = settings.remembers
    metrics = Metrics(queue_depth=lambda: worker.queue_depth, in_flight=lambda: worker.running,
                      kv_cache=lambda: (worker.batch.kv_reserved, worker.batch.kv_budget))
    worker = Worker(pool, metrics, max_queue=settings.max_queue, timeout=settings.request_timeout,
                    max_batch=settings.max_batch, kv_budget=settings.kv_budget, prefix_cache_bytes=prefix_cache_bytes)
    return worker, metrics


def create_app(pool: DecoderPool, settings: ServerSettings) -> FastAPI:
    """The server over `pool`'s models: one engine thread (batching up to `settings.max_batch` sequences), a queue
    of `settings.max_queue` in front of it. Requests without a seed draw one from the OS, so restarts and replicas
    sample differently (the response reports it); with `settings.seed` they draw the same sequence every time."""
    worker, metrics = _engine(pool, settings)
    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.settings = worker, metrics, settings
    app.state.seeds = random.SystemRandom() if settings.seed is None else random.Random(settings.seed)
    app.state.keys = [key.encode() for key in settings.api_keys()]
    app.state.started = int(time.time())
    app.state.preparing = threading.Lock()  # one tokenizer, used by one preparing thread at a time

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, bug)

    keyed = [Depends(check_key)]
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/models", models, methods=["GET"], dependencies=keyed)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"], dependencies=keyed)
    app.add_api_route("/metrics", prometheus, methods=["GET"], dependencies=keyed)
    app.add_api_route("/", playground, methods=["GET"], response_class=HTMLResponse)
    return app
