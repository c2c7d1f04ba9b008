"""Every route the app serves, in two tables: ``ROUTES``, the POST endpoints whose JSON
body is parsed into a model before the handler sees it (the models are also
``/openapi.json``'s schemas), and ``BARE_ROUTES``, the routes with no body to parse (the
GET endpoints, the prefix-cache reset, the roles override), each a handler of the context
and the request. ``frontend.http.app.build_app`` adds both; nothing else adds a route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.api.anthropic.messages import count_tokens, create_message
from frontend.api.anthropic.messages_request import CountTokensRequest, MessagesRequest
from frontend.api.common.context import ServingContext
from frontend.api.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NativeGenerateRequest,
    TokenizeRequest,
)
from frontend.api.native.generate import generate
from frontend.api.native.lora import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from frontend.api.native.tokenize import detokenize, tokenize, version_response
from frontend.api.openai.chat_completions import create_chat_completion
from frontend.api.openai.completions import create_completion
from frontend.api.openai.responses import create_response
from frontend.api.openai.responses_request import ResponsesRequest
from frontend.http.health import health_response
from frontend.http.reset_route import reset_prefix_cache
from frontend.http.roles_route import set_roles

B = TypeVar(
    "B",
    CompletionRequest,
    ChatCompletionRequest,
    NativeGenerateRequest,
    TokenizeRequest,
    DetokenizeRequest,
    MessagesRequest,
    CountTokensRequest,
    ResponsesRequest,
)
Handler = Callable[[ServingContext, Request, B, float], Awaitable[Response]]
BareHandler = Callable[[ServingContext, Request], Awaitable[Response]]

# Every POST endpoint: its body's model (also its schema in /openapi.json) and handler.
ROUTES: dict[str, tuple[type[Any], Handler[Any]]] = {
    "/v1/completions": (CompletionRequest, create_completion),
    "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
    "/v1/messages": (MessagesRequest, create_message),
    "/v1/messages/count_tokens": (CountTokensRequest, count_tokens),
    "/v1/responses": (ResponsesRequest, create_response),
    "/generate": (NativeGenerateRequest, generate),
    "/tokenize": (TokenizeRequest, tokenize),
    "/detokenize": (DetokenizeRequest, detokenize),
    "/v1/load_lora_adapter": (LoadLoraAdapterRequest, load_lora_adapter),
    "/v1/unload_lora_adapter": (UnloadLoraAdapterRequest, unload_lora_adapter),
}


async def _version(ctx: ServingContext, request: Request) -> Response:
    return version_response()


async def _models(ctx: ServingContext, request: Request) -> Response:
    s = ctx.settings
    card = {
        "id": s.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "max_model_len": s.max_model_len,
        "deterministic": s.deterministic,  # batch-invariant serving
    }
    adapters = ctx.loras.cards() if ctx.loras is not None else []
    return JSONResponse({"object": "list", "data": [card, *adapters]})


async def _health(ctx: ServingContext, request: Request) -> Response:
    # Reached only when the accept thread's fast path is bypassed (frontend/http/server.py).
    return health_response(ctx.client, ctx.settings.deterministic)


async def _metrics(ctx: ServingContext, request: Request) -> Response:
    payload, content_type = ctx.metrics.render()
    return Response(payload, media_type=content_type)


# Every route without a body to parse: (method, path) -> handler.
BARE_ROUTES: dict[tuple[str, str], BareHandler] = {
    ("GET", "/version"): _version,
    ("GET", "/v1/models"): _models,
    ("GET", "/health"): _health,
    ("GET", "/metrics"): _metrics,
    ("POST", "/reset_prefix_cache"): reset_prefix_cache,
    ("POST", "/roles"): set_roles,
}
