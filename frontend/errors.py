"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, and
on Anthropic's paths (``/v1/messages...``) in Anthropic's: ``{"type": "error", "error":
{"type", "message"}}``, its type named by the status as Anthropic names it.

Handlers raise ``APIError`` (or a subclass); ``frontend.http.app`` turns it into a JSON
response. Anything else that escapes a handler becomes a 500 with a generic message and
a logged traceback, never a crashed server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fastapi.responses import JSONResponse

ANTHROPIC_PATHS = "/v1/messages"  # the prefix of every path that answers in Anthropic's shape
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",  # a request (head or body) that arrived too late
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI error body."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status)
        if kind is None:
            kind = "invalid_request_error" if self.status < 500 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def headers(self) -> dict[str, str] | None:
        return None

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def body_for(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API ``path`` belongs to."""
        return self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()

    def response_for(self, path: str) -> JSONResponse:
        """The response in the shape of the API ``path`` belongs to."""
        return JSONResponse(self.body_for(path), status_code=self.status, headers=self.headers())


class InvalidRequest(APIError):
    """Malformed JSON, wrong types, out-of-range values, too-long prompts: 400."""


# The limits a request may go over, as /metrics labels its refusals; each is a ``launch``
# flag (dashes for underscores; docs/reliability.md).
LIMITS = ("max_json_depth", "max_tools_bytes", "max_schema_bytes", "grammar_compile_timeout")


class LimitExceeded(InvalidRequest):
    """A request over one of the server's limits (a ``launch`` flag): 400 naming the limit
    and the request's value, refused before any work is spent on it."""

    def __init__(self, limit: str, bound: float, what: str, param: str | None = None) -> None:
        flag = "--" + limit.replace("_", "-")
        super().__init__(
            f"{what}, over the limit {limit} = {bound:g} (launch {flag})",
            param=param,
            code="limit_exceeded",
        )
        self.limit = limit


def field_path(parts: Iterable[str | int]) -> str:
    """A field's path as clients read it: ``messages[2].content[0].type``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class NotImplementedField(APIError):
    """A known OpenAI field whose feature this server does not implement: 400."""

    def __init__(self, param: str, what: str) -> None:
        super().__init__(
            f"'{param}' is not supported by this server: {what}",
            param=param,
            code="unsupported_parameter",
        )


class ModelNotFound(APIError):
    status = 404

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(
            f"The model '{requested}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )


class Unauthorized(APIError):
    status = 401
    error_type = "authentication_error"

    def __init__(self) -> None:
        super().__init__(
            "Missing or invalid API key: send 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')",
            code="invalid_api_key",
        )


class PayloadTooLarge(APIError):
    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body exceeds the {limit} byte limit", code="request_too_large")


class UnsupportedMediaType(APIError):
    status = 415

    def __init__(self, got: str | None) -> None:
        super().__init__(
            f"Content-Type must be application/json, got {got or 'none'}",
            code="unsupported_media_type",
        )


class MisdirectedRequest(APIError):
    """A Host header that does not name this server (DNS-rebinding defence): 421."""

    status = 421

    def __init__(self, name: str) -> None:
        super().__init__(
            f"Host '{name}' is not served here: start the server with --allowed-hosts "
            f"{name} (or with --api-key)",
            code="host_not_allowed",
        )


class ServiceUnavailable(APIError):
    """Overload: 503 with Retry-After in whole seconds (at least 1)."""

    status = 503
    error_type = "server_error"

    def __init__(
        self, retry_after_s: float, message: str = "Server overloaded", code: str = "overloaded"
    ) -> None:
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(f"{message}; retry after {seconds} s", code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}  # as the message


class InternalError(APIError):
    status = 500
    error_type = "server_error"

    def __init__(self, message: str = "Internal server error") -> None:
        super().__init__(message, code="internal_error")


class EngineFailed(InternalError):
    """The engine ended the request with an error (its constraint allowed no next token,
    it was poison, it can never fit): a 500 on the APIs with no error finish of their own.
    The same request would fail the same way, so the SDKs, which retry a 500 twice by
    default, are told not to (``x-should-retry: false``, which OpenAI's and Anthropic's
    both read): a poison request's retries would each take workers down again."""

    def __init__(self, why: str | None) -> None:
        super().__init__(f"the engine failed this request: {why}")

    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}
