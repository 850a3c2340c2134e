"""ASGI middleware of the app: `RequestCounter` (answered requests by route and status, for the metrics) and
`BodyLimit` (a 413 for a body past the limit, before anything reads it)."""

from __future__ import annotations

from specdraft.server.errors import ApiError
from specdraft.server.metrics import Metrics

# Routes counted by name in the metrics (anything else is counted as "other").
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


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
