"""The FastAPI app: OpenAI-compatible routes, health, metrics, the playground, and API-key checks."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import random
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import Enum
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdraft.batch_engine import DEFAULT_PREFIX_CACHE_BYTES
from specdraft.errors import SpecdraftError
from specdraft.server.decoders import DecoderPool
from specdraft.server.errors import ApiError
from specdraft.server.metrics import Metrics
from specdraft.server.prepare import Generation, prepare
from specdraft.server.responses import ResponseShape, sse
from specdraft.server.schemas import ChatCompletionRequest, CompletionRequest
from specdraft.server.worker import Failed, Finished, Job, Step, Worker, timeout_error

# How often a request waiting for its results checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.25
# Routes counted by name in the metrics (anything else is counted as "other").
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


class CrossRequestMemory(str, Enum):
    """Who shares what the server remembers across requests (the prefix cache, the `suffix` drafter's corpus), which
    `usage.prompt_tokens_details.cached_tokens`, the tokens' `kinds` and the time to the first token let a client
    probe. A request's `cache_salt` partitions it further in `shared` and `key`."""

    shared = "shared"  # every request (of the same cache_salt)
    key = "key"  # requests sent with the same API key (of the same cache_salt)
    off = "off"  # nobody: no prefix cache, and the drafters remember no earlier request


@dataclass
class ServerSettings:
    """What `specdraft serve` sets besides the models: names, limits, the keys (`api_key`: one, or several separated
    by commas), who shares cross-request memory."""

    served_model: str
    api_key: str | None = None
    max_queue: int = 64
    request_timeout: float = 600.0
    default_max_tokens: int = 256
    shutdown_grace: float = 10.0
    seed: int | None = None  # seeds the seeds of requests that give none; None: each drawn from the OS
    max_body_bytes: int = 2 << 20  # a larger request body is refused (413) before it is read
    max_batch: int = 1  # sequences generating together (continuous batching); 1: one request at a time
    kv_budget: int | None = None  # bytes of KV cache the batch's sequences may reserve together; None: unbounded
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # rows of prompts read before, kept for their prefixes; 0: none
    cross_request_memory: CrossRequestMemory = CrossRequestMemory.shared

    def __post_init__(self) -> None:
        try:
            self.cross_request_memory = CrossRequestMemory(self.cross_request_memory)
        except ValueError:
            modes = ", ".join(mode.value for mode in CrossRequestMemory)
            raise SpecdraftError(f"--cross-request-memory must be one of {modes}, got {self.cross_request_memory!r}."
                                 ) from None
        if self.api_key is not None and not self.api_keys():
            raise SpecdraftError("--api-key holds no key; give one, or several separated by commas.")

    def api_keys(self) -> list[str]:
        """The keys a client may send (none: the server is open)."""
        return [key.strip() for key in (self.api_key or "").split(",") if key.strip()]


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


class RequestCounter:
    """ASGI middleware counting answered requests by route and status (streams count when they start)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.record_request(endpoint, message["status"])
            await send(message)

        return await self.app(scope, receive, counting_send)


class BodyLimit:
    """ASGI middleware refusing request bodies over `limit` bytes with a 413: at once when Content-Length says
    so, else as soon as the bytes received pass it (a chunked body), before anything parses them."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    def too_large(self) -> ApiError:
        return ApiError(413, f"The request body is larger than this server takes ({self.limit} bytes); send a "
                             "shorter prompt, or start the server with a larger --max-body-mb.",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.too_large().response()(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self.too_large()
            return message

        return await self.app(scope, counting_receive, send)


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


def create_app(pool: DecoderPool, settings: ServerSettings) -> FastAPI:
    """The server over `pool`'s models: one engine thread (batching up to `settings.max_batch` sequences), a queue
    of `settings.max_queue` in front of it. Requests without a seed draw one from the OS, so restarts and replicas
    sample differently (the response reports it); with `settings.seed` they draw the same sequence every time."""
    seeds = random.SystemRandom() if settings.seed is None else random.Random(settings.seed)
    started = int(time.time())
    remember = settings.cross_request_memory != CrossRequestMemory.off
    prefix_cache_bytes = settings.prefix_cache_bytes if remember else 0
    pool.remember = remember
    keys = [key.encode() for key in settings.api_keys()]
    metrics = Metrics(queue_depth=lambda: worker.queue_depth, in_flight=lambda: worker.running,
                      kv_cache=lambda: (worker.batch.kv_reserved, worker.batch.kv_budget))
    worker = Worker(pool, metrics, max_queue=settings.max_queue, timeout=settings.request_timeout,
                    max_batch=settings.max_batch, kv_budget=settings.kv_budget, prefix_cache_bytes=prefix_cache_bytes)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop, settings.shutdown_grace)

    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.settings = worker, metrics, settings
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)

    def bearer(request: Request) -> str | None:
        """The key the request sent ('Authorization: Bearer <key>'), if any."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    def check_key(request: Request) -> None:
        if not keys:
            return
        token = (bearer(request) or "").encode()
        if not sum(hmac.compare_digest(token, key) for key in keys):  # every key compared: no early exit
            raise ApiError(401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def tenant(request: Request) -> str:
        """The part of the cross-request memory the request's client shares: with `key`, that of its API key (a
        digest: the key itself is kept nowhere); else everyone's ("")."""
        if settings.cross_request_memory != CrossRequestMemory.key:
            return ""
        return hashlib.sha256((bearer(request) or "").encode()).hexdigest()

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = {404: "No such route; the API lives under /v1 (GET /v1/models).",
                   405: "This route does not take that method."}.get(error.status_code, str(error.detail))
        return ApiError(error.status_code, message).response()

    @app.exception_handler(Exception)
    async def bug(_request: Request, _error: Exception) -> JSONResponse:
        return ApiError(500, "The server failed on this request; this is a bug, please report it.",
                        code="internal_error").response()

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

    preparing = threading.Lock()  # one tokenizer, used by one preparing thread at a time

    def checked(schema: type[ChatCompletionRequest] | type[CompletionRequest], body: bytes, part: str) -> Generation:
        """The request in `body`, parsed, validated and tokenized (ApiError 4xx where it is wrong); `part`: its
        `tenant`."""
        try:
            parsed = schema.model_validate_json(body)
        except ValidationError as error:
            raise _validation_error(error) from None
        with preparing:
            worker.check_room()  # the queue may have filled while this request waited for the tokenizer
            return prepare(parsed, pool, settings.served_model, settings.default_max_tokens, seeds, part)

    async def answer(schema: type[ChatCompletionRequest] | type[CompletionRequest], request: Request) -> Response:
        worker.check_room()  # a full queue answers 429 before the body is read, parsed and tokenized
        # Parsing and tokenizing a long prompt takes seconds: off the event loop, which keeps answering meanwhile.
        generation = await asyncio.to_thread(checked, schema, await request.body(), tenant(request))
        return await generate(generation, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions over the model's chat template (streamed as SSE with `stream: true`);
        the body is a `ChatCompletionRequest`."""
        return await answer(ChatCompletionRequest, request)

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(request: Request) -> Response:
        """OpenAI text completions of a raw prompt (text or token ids); the body is a `CompletionRequest`."""
        return await answer(CompletionRequest, request)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict:
        """The one served model, with the drafters a request may ask for, the server's defaults and the largest
        fixed k it takes."""
        default = pool.default
        return {"object": "list", "data": [{
            "id": settings.served_model, "object": "model", "created": started, "owned_by": "specdraft",
            "max_context": pool.target.max_context,
            "specdraft": {"drafters": pool.drafters(), "default": {"drafter": default.drafter, "k": default.k},
                          "max_k": pool.max_k},
        }]}

    @app.get("/health")
    async def health() -> dict:
        """Liveness, open without a key: the queue and whether the engine is busy."""
        return {"status": "ok", "queue_depth": worker.queue_depth, "running": worker.running}

    @app.post("/reset_prefix_cache", dependencies=[Depends(check_key)])
    async def reset_prefix_cache() -> dict:
        """Forget the prompts kept for their prefixes, so the next prompts are read whole (a benchmark's cold
        start); `cleared` is false where the server keeps none (not exact here, or --prefix-cache-mb 0)."""
        prefixes = worker.batch.prefixes
        if prefixes is not None:
            prefixes.clear()
        return {"cleared": prefixes is not None}

    @app.get("/metrics", dependencies=[Depends(check_key)])
    async def prometheus() -> PlainTextResponse:
        """Prometheus text: requests, tokens, α, τ, acceptance per draft position, time per token, queue."""
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        """The playground page (open: it holds no data; its API calls send the key typed into it)."""
        return HTMLResponse(resources.files("specdraft.server").joinpath("static/playground.html").read_text())

    return app
