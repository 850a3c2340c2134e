"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx for what a user sent."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# The OpenAI error type of each status this server answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_unavailable_error", 504: "timeout_error"}


class ApiError(Exception):
    """An error answered as OpenAI error JSON with `status`; `headers` (e.g. Retry-After) go with it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body (also sent as an SSE `data:` event when a stream has already begun)."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
