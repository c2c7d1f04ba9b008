"""One engine call per choice: its lifecycle from admission to the last delta.

``EngineCall`` is the only code that iterates ``EngineClient.generate``. It owns three
promises of the HTTP layer: admission errors become 503/500 before any byte is sent; a
client that disconnects has its request aborted (watched while waiting for the first
token, and by Starlette's disconnect listener while streaming); and every finished
request is recorded in the metrics exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from starlette.requests import Request

from frontend.api.common.context import ServingContext
from frontend.engine_link.engine_client import (
    EngineRequest,
    EngineUnavailable,
    Overloaded,
)
from frontend.errors import InternalError, ServiceUnavailable
from wire.records import Finish, TextDelta, TokenLogprob

logger = logging.getLogger(__name__)
T = TypeVar("T")

FINISH_REASONS = {
    Finish.STOP: "stop",
    Finish.LENGTH: "length",
    Finish.ABORT: "abort",
    Finish.ERROR: "error",
}


class ClientGone(Exception):
    """The HTTP client disconnected; its request has been aborted."""


@dataclass
class Generation:
    """Everything a non-streaming response needs, accumulated from the deltas."""

    text: str = ""
    reasoning: str = ""  # with --reasoning-parser; ``text`` is then the answer
    reasoning_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish = Finish.NONE
    stop_reason: str | int | None = None
    error: str | None = None

    def add(self, d: TextDelta) -> None:
        self.text += d.text
        self.reasoning += d.reasoning
        self.reasoning_tokens = d.reasoning_tokens or self.reasoning_tokens
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs or ())
        if d.finish:
            self.finish, self.stop_reason, self.error = Finish(d.finish), d.stop_reason, d.error

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.finish)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then raise ``ClientGone``)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # NOTE: wait for the cancellation to unwind. ``work`` is often an engine
            # generator's __anext__; until it has, the generator is still running and the
            # caller's abort (which closes it) fails with "aclose(): asynchronous
            # generator is already running".
            await asyncio.wait([task])
    if not task.cancelled():
        return task.result()
    raise ClientGone()


class EngineCall:
    """One request's trip through the engine, with metrics and abort-on-exit."""

    def __init__(self, ctx: ServingContext, req: EngineRequest, arrival: float) -> None:
        self.ctx, self.req, self.arrival = ctx, req, arrival
        self._agen = ctx.client.generate(req)
        self._first: TextDelta | None = None
        self._last_token_at: float | None = None
        self._num_tokens = 0
        self.finished = False
        # Prompt tokens served from the prefix cache, as the first attempt reported them
        # (a request resumed after a worker death may hit or miss again: not counted).
        self.cached_tokens: int | None = None
        # Speculation's counts over the tokens received (DetokParams.count_drafts only).
        self.drafted_tokens = 0
        self.accepted_tokens = 0

    async def start(self, request: Request) -> None:
        """Admit the request and wait for its first delta (aborted if the client leaves)."""
        await start_all([self], request)

    async def admit(self) -> None:
        """Admit the request and wait for its first delta; ``start_all`` aborts on failure."""
        try:
            self._first = await self._agen.__anext__()
        except Overloaded as e:
            self.ctx.metrics.refused.inc()
            raise ServiceUnavailable(e.retry_after_s, str(e)) from e
        except EngineUnavailable as e:
            logger.error("rid=%d engine error at admission: %s", self.req.rid, e)
            raise InternalError(f"engine failure: {e}") from e
        except StopAsyncIteration as e:
            raise InternalError("the engine ended the request without a final delta") from e
        if self.req.fork_of < 0:  # the choices of one request share one prompt
            self.ctx.metrics.prompt_tokens.inc(len(self.req.prompt_ids))
        self._observe(self._first)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """The deltas after ``start``: the first one, then the rest; aborts on early exit."""
        assert self._first is not None, "start() must succeed first"
        try:
            yield self._first
            while not self.finished:
                delta = await self._agen.__anext__()
                self._observe(delta)
                yield delta
        except StopAsyncIteration:
            logger.error("rid=%d stream ended without a final delta", self.req.rid)
            raise EngineUnavailable("the engine ended the request without a final delta") from None
        finally:
            if not self.finished:
                await self._abort()
            else:  # let the client's generator run its cleanup now, not at GC time
                await self._agen.aclose()  # type: ignore[attr-defined]

    async def collect(self, request: Request) -> Generation:
        """Run to completion for a non-streaming response."""
        return (await collect_all([self], request))[0]

    def _observe(self, d: TextDelta) -> None:
        now = time.monotonic()
        if self.cached_tokens is None:
            self.cached_tokens = d.cached_tokens
        self.drafted_tokens += d.drafted_tokens
        self.accepted_tokens += d.accepted_tokens
        if d.token_ids:
            if self._last_token_at is None:
                self.ctx.metrics.ttft.observe(now - self.arrival)
            else:
                self.ctx.metrics.itl.observe(now - self._last_token_at)
            self._last_token_at = now
            self._num_tokens += len(d.token_ids)
            self.ctx.metrics.generation_tokens.inc(len(d.token_ids))
        if d.finish:
            self.finished = True
            reason = FINISH_REASONS.get(Finish(d.finish), "unknown")
            self.ctx.metrics.e2e.observe(now - self.arrival)
            self.ctx.metrics.requests.labels(finish_reason=reason).inc()
            logger.debug("rid=%d finished: %s, %d tokens", self.req.rid, reason, self._num_tokens)

    async def _abort(self) -> None:
        self.finished = True
        # Shielded: we are often here because our task was cancelled (client gone).
        with anyio.CancelScope(shield=True):
            try:
                await self.ctx.client.abort(self.req.rid)
                await self._agen.aclose()  # type: ignore[attr-defined]
            except Exception:
                logger.exception("rid=%d abort failed", self.req.rid)
        logger.info("rid=%d aborted", self.req.rid)


def predictions(calls: list[EngineCall]) -> tuple[int, int] | None:
    """(accepted, rejected) drafts of every choice, for OpenAI's usage
    (``accepted_prediction_tokens``, ``rejected_prediction_tokens``); None unless the
    request opted in (``return_prediction_tokens_details``).

    Accepted drafts are output tokens speculation verified in bulk; rejected ones are
    drafts that are not in the output (refused by the model, or past a stop). Both are
    zero when no draft was verified (speculation off, or gated off for the request).
    """
    if not calls or not calls[0].req.detok.count_drafts:
        return None
    accepted = sum(c.accepted_tokens for c in calls)
    return accepted, sum(c.drafted_tokens for c in calls) - accepted


async def start_all(calls: list[EngineCall], request: Request) -> None:
    """Admit every call and wait for each one's first delta; if one fails, or the client
    leaves, every call is aborted. The calls are submitted in order (``n > 1``: the
    first choice, which the others fork from, goes first)."""
    work = calls[0].admit() if len(calls) == 1 else asyncio.gather(*(c.admit() for c in calls))
    try:
        await until_disconnect(request, work)
    except BaseException:
        for c in calls:
            if not c.finished:
                await c._abort()
        raise


async def collect_all(calls: list[EngineCall], request: Request) -> list[Generation]:
    """Run every started call to completion (non-streaming); aborts all on early exit."""

    async def run(call: EngineCall) -> Generation:
        gen = Generation()
        async for d in call.deltas():
            gen.add(d)
        return gen

    async def run_all() -> list[Generation]:
        if len(calls) == 1:
            return [await run(calls[0])]
        return list(await asyncio.gather(*(run(c) for c in calls)))

    try:
        return await until_disconnect(request, run_all())
    finally:
        for c in calls:
            if not c.finished:
                await c._abort()
