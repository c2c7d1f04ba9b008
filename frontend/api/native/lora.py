"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's names and
bodies); the registry they change is ``lora_registry.py``, and which adapter a request's
``model`` names is ``context.check_model``. An unload also reaches every worker at once
(``UnloadLora``): each frees the adapter's slot between two steps, without waiting for
the next load to evict it."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.api.common.context import ServingContext
from frontend.api.common.lora_registry import LoraRegistry
from frontend.api.common.protocol import Body
from frontend.errors import InvalidRequest


class LoadLoraAdapterRequest(Body):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(Body):
    lora_name: str


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
    registry = _registry(ctx)
    ref = registry.unload(body.lora_name)
    if not registry.serves(ref.fingerprint):  # the same files under another name stay
        await ctx.client.unload_lora(ref.fingerprint)
    return JSONResponse({"status": "ok", "lora_name": body.lora_name})
