"""Server-sent events: OpenAI's ``data:`` frames ending in ``[DONE]``, the named events of
Anthropic's and the Responses API, keep-alives; an engine failure mid-stream becomes the
API's own error frame."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
import msgspec

from frontend.engine_link.engine_client import EngineUnavailable
from frontend.errors import APIError, InternalError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def sse(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def _framed(
    items: AsyncIterator[Any],
    rid: int,
    frame: Callable[[Any], bytes],
    error_frame: Callable[[APIError], bytes],
) -> AsyncIterator[bytes]:
    """``items`` framed; an engine failure mid-stream becomes the API's error frame."""
    try:
        async for item in items:
            yield frame(item)
    except (EngineUnavailable, APIError) as e:
        logger.error("rid=%d failed mid-stream: %s", rid, e)
        err = e if isinstance(e, APIError) else InternalError(f"engine failure: {e}")
        yield error_frame(err)


async def sse_stream(chunks: AsyncIterator[object], rid: int) -> AsyncIterator[bytes]:
    """Frame ``chunks`` as SSE; an engine failure mid-stream becomes an error event."""
    async for frame in _framed(chunks, rid, sse, lambda err: sse(err.body())):
        yield frame
    yield SSE_DONE


def typed_sse(payload: dict[str, Any]) -> bytes:
    """An SSE event named by its payload's ``type`` (Anthropic's and Responses' framing)."""
    name = str(payload["type"]).encode()
    return b"event: " + name + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


async def typed_sse_stream(
    events: AsyncIterator[dict[str, Any]],
    rid: int,
    error_event: Callable[[APIError], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """Frame ``events`` as named SSE events; an engine failure mid-stream becomes the
    API's error event (there is no ``[DONE]`` in these APIs)."""
    async for frame in _framed(events, rid, typed_sse, lambda err: typed_sse(error_event(err))):
        yield frame


async def with_keepalive(source: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """``source``'s items, and None whenever ``interval_s`` passes without one (a
    keep-alive for streams whose clients or proxies drop a quiet connection)."""
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait([pending], timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(source))
    finally:
        # Shielded: we are often here because the client left and our task was cancelled;
        # closing ``source`` is what aborts the request in the engine.
        with anyio.CancelScope(shield=True):
            if not pending.done():
                pending.cancel()
                # NOTE: let the cancelled step unwind before closing the generator, or
                # aclose() finds it still running (see until_disconnect).
                await asyncio.wait([pending])
            await source.aclose()  # type: ignore[attr-defined]
