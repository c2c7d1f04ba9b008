"""The FastAPI app: routing, body limits, JSON parsing and error shaping.

Handlers live in ``frontend/api/`` and every route in ``frontend/http/routes.py``; this
module only gets a request to them and turns every failure into an OpenAI-shaped error. No input reaches a handler unparsed, and no
exception escapes as anything but a JSON error (500 for our bugs, logged with traceback).
Who may call at all (Host, API key, Content-Type) is decided before, by
``frontend.http.guard.Guard``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.api.common.call import ClientGone
from frontend.api.common.context import ServingContext
from frontend.api.common.limits import check_depth, too_deep
from frontend.api.common.lora_registry import LoraRegistry
from frontend.api.common.protocol import (
    parse_body,
)
from frontend.engine_link.engine_client import EngineClient, Overloaded
from frontend.engine_link.grammar_pool import GrammarPool
from frontend.engine_link.grammar_worker import WorkerConfig
from frontend.errors import (
    APIError,
    InternalError,
    InvalidRequest,
    LimitExceeded,
    PayloadTooLarge,
    ServiceUnavailable,
)
from frontend.http.guard import JSON_PATHS, Guard
from frontend.http.health import health_response
from frontend.http.log_bounds import bounded_traceback, clip, ignored_fields
from frontend.http.openapi import with_request_bodies
from frontend.http.routes import BARE_ROUTES, ROUTES, B, BareHandler, Handler
from frontend.settings import FrontendSettings
from frontend.telemetry.metrics import FrontendMetrics
from frontend.telemetry.stats_log import StatsLog

logger = logging.getLogger(__name__)


async def read_json(request: Request, limit: int, max_depth: int = 64) -> object:
    """The body as JSON, refusing more than ``limit`` bytes before reading them all, and
    JSON nested more than ``max_depth`` levels anywhere."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(limit)
        chunks.append(chunk)
    try:
        # msgspec, unlike json, refuses lone surrogates and NaN: no such text or number
        # can reach the tokenizer or a ring record.
        raw = b"".join(chunks)
        body = msgspec.json.decode(raw)
    except UnicodeDecodeError as e:  # a string that is not UTF-8 (msgspec raises it as is)
        raise InvalidRequest(f"malformed JSON body: invalid UTF-8 at byte {e.start}") from e
    except ValueError as e:  # msgspec.DecodeError, and whatever else a decoder refuses with
        raise InvalidRequest(f"malformed JSON body: {e}") from e
    except RecursionError:
        raise too_deep(max_depth) from None
    check_depth(body, max_depth, raw=raw)
    return body


class _Throttled:
    """At most one log line per interval; the next line counts the ones it swallowed.

    Under overload every refused request would otherwise log a line, and the logging
    itself would slow the event loop that has to refuse them.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.next_at = 0.0
        self.swallowed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.swallowed += 1
            return
        if self.swallowed:
            msg, args = msg + " (and %d more since the last report)", (*args, self.swallowed)
        logger.warning(msg, *args)
        self.swallowed, self.next_at = 0, now + self.interval_s


_server_errors = _Throttled()


async def _serve(
    ctx: ServingContext, request: Request, model: type[B], handler: Handler[B]
) -> Response:
    arrival = time.monotonic()
    s = ctx.settings
    try:
        body = parse_body(model, await read_json(request, s.max_body_bytes, s.max_json_depth))
        if unknown := body.unknown_fields():
            logger.info("%s", ignored_fields(request.url.path, unknown))  # one bounded line
        return await handler(ctx, request, body, arrival)
    except LimitExceeded as e:
        ctx.metrics.limit_refusals.labels(limit=e.limit).inc()
        logger.info("%s: refused: %s", request.url.path, clip(e.message))
        return e.response_for(request.url.path)
    except APIError as e:
        if e.status >= 500:
            _server_errors.warning("%s: %d %s", request.url.path, e.status, clip(e.message))
        return e.response_for(request.url.path)
    except (ClientGone, ClientDisconnect):
        # Ordinary client behaviour (a timeout, a cancelled upload): nothing to log loudly.
        logger.info("%s: the client disconnected before the response", request.url.path)
        return Response(status_code=499)  # nobody is listening; nginx's code for it
    except Exception as e:
        # Our bug, not the client's: logged with an id the client is given too, so that a
        # report can be matched to its traceback. The frontend serves on.
        incident = f"req-{secrets.token_hex(6)}"
        logger.error(  # the traceback bounded: its message may quote the request
            "%s: unhandled error (request id %s)\n%s",
            request.url.path,
            incident,
            bounded_traceback(e),
        )
        err = InternalError(f"Internal server error (request id {incident})")
        response = err.response_for(request.url.path)
        response.headers["x-request-id"] = incident
        return response


def _bare_endpoint(
    ctx: ServingContext, handler: BareHandler
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(ctx, request)

    return endpoint


def _endpoint(
    ctx: ServingContext, model: type[B], handler: Handler[B]
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await _serve(ctx, request, model, handler)

    return endpoint


GENERATE_PATHS = JSON_PATHS


class FastPaths:
    """Pure ASGI, in front of routing: ``GET /health``, and 503 for generation requests
    while no request could be admitted (``EngineClient.check_admission``).

    Why: under a burst of hundreds of requests beyond the admission bound, the event loop
    runs each request's handler in turn, FIFO. Through the whole FastAPI stack a refusal
    costs about half a millisecond, so a burst of 500 holds a /health probe behind it for
    a quarter of a second; answered here, each costs a fraction of that. Requests get here
    past the ``Guard`` (key, Host, Content-Type already checked); the rest take the normal
    path.
    """

    def __init__(
        self, app: ASGIApp, client: EngineClient, metrics: FrontendMetrics, deterministic: bool
    ) -> None:
        self.app, self.client, self.metrics = app, client, metrics
        self.deterministic = deterministic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if path == "/health" and method == "GET":
                await health_response(self.client, self.deterministic)(scope, receive, send)
                return
            if path in GENERATE_PATHS and method == "POST":
                try:
                    self.client.check_admission()
                except Overloaded as e:
                    self.metrics.refused.inc()
                    refusal = ServiceUnavailable(e.retry_after_s, str(e))
                    response = refusal.response_for(path)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


FRONTEND_HEADER = b"x-pdserve-frontend"


class NameFrontend:
    """Pure ASGI: every response says which frontend process served it (``launch
    --api-workers``), so a client or a test can tell them apart behind the shared port."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app, self._header = app, (FRONTEND_HEADER, str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        await self.app(scope, receive, named)


def _warn_if_exposed(settings: FrontendSettings) -> None:
    try:
        loopback = settings.host == "localhost" or ipaddress.ip_address(settings.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and settings.api_key is None:
        logger.warning(
            "binding %s without an API key: anyone who can reach it can use it", settings.host
        )


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` is a file path or the template text itself."""
    if value is None or "{" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return path.read_text()


def build_app(client: EngineClient, tokenizer: Any, settings: FrontendSettings) -> FastAPI:
    """The HTTP app over ``client``; the app closes the client when it shuts down."""
    _warn_if_exposed(settings)
    settings = replace(settings, chat_template=load_chat_template(settings.chat_template))
    telemetry = FrontendMetrics(client)
    worker = WorkerConfig(
        model_dir=str(getattr(tokenizer, "name_or_path", "")),
        vocab_size=settings.vocab_size,
        stop_ids=list(settings.eos_token_ids),
    )
    grammars = GrammarPool(
        worker,
        settings.grammar_compile_timeout_s,
        settings.grammar_workers,
        on_compile=telemetry.grammar_compiles.inc,
        on_hit=telemetry.grammar_cache_hits.inc,
    )
    loras = LoraRegistry(settings, client.lora_table) if settings.max_loras > 0 else None
    ctx = ServingContext(client, tokenizer, settings, telemetry, grammars, loras)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(ctx.metrics.publish_every())]
        if client.owner == 0:  # one stats line per server, of the server-wide figures
            tasks.append(asyncio.create_task(StatsLog(client, ctx.metrics).run()))
        yield
        for task in tasks:
            task.cancel()
        await grammars.close()
        await client.close()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(
        FastPaths, client=client, metrics=ctx.metrics, deterministic=settings.deterministic
    )
    app.add_middleware(Guard, settings=settings)
    app.add_middleware(NameFrontend, index=client.owner)  # added last: outermost

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return APIError(str(exc.detail), status=exc.status_code).response_for(request.url.path)

    for path, (model, handler) in ROUTES.items():
        app.add_api_route(path, _endpoint(ctx, model, handler), methods=["POST"])
    app.openapi = with_request_bodies(  # type: ignore[method-assign]
        app, {path: model for path, (model, _) in ROUTES.items()}
    )

    for (method, path), bare in BARE_ROUTES.items():
        app.add_api_route(path, _bare_endpoint(ctx, bare), methods=[method])
    return app
