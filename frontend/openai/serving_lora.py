"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's names and
bodies), and which adapter a request's ``model`` names (``lora_registry.py``)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.errors import InvalidRequest, ModelNotFound
from frontend.openai.lora_registry import LoraRegistry
from frontend.openai.protocol import Body
from frontend.openai.serving_common import ServingContext
from wire.params import LoraRef


class LoadLoraAdapterRequest(Body):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(Body):
    lora_name: str


def resolve_model(ctx: ServingContext, requested: str | None) -> LoraRef | None:
    """A request's ``model``: None for the base (or none given), the adapter's ref for a
    registered adapter; else 404 naming what is served."""
    names = (ctx.settings.model_name, *ctx.settings.model_aliases)
    if requested is None or requested in names:
        return None
    ref = ctx.loras.resolve(requested) if ctx.loras is not None else None
    if ref is None:
        raise ModelNotFound(requested, ctx.settings.model_name)
    return ref


def _registry(ctx: ServingContext) -> LoraRegistry:
    if ctx.loras is None:
        raise InvalidRequest("LoRA adapters are off: start the server with --enable-lora")
    return ctx.loras


async def load_lora_adapter(
    ctx: ServingContext, request: Request, body: LoadLoraAdapterRequest, arrival: float
) -> Response:
    # Reading the header and hashing the weights is file I/O: off the event loop.
    await asyncio.to_thread(_registry(ctx).load, body.lora_name, body.lora_path)
    return JSONResponse({"status": "ok", "lora_name": body.lora_name})


async def unload_lora_adapter(
    ctx: ServingContext, request: Request, body: UnloadLoraAdapterRequest, arrival: float
) -> Response:
    _registry(ctx).unload(body.lora_name)
    return JSONResponse({"status": "ok", "lora_name": body.lora_name})
