"""``LocalEngineClient``: the project's engine and detokenizer in this process.

One engine thread owns a ``ModelRunner`` driven by ``ColocatedScheduler`` (the same loop a
``launch --colocated`` worker runs) and a ``detokenizer.shard.DetokShard``. The event
loop talks to it through a queue and gets ``TextDelta``s back with
``call_soon_threadsafe``; the thread blocks on its inbox when no request is active, so an
idle client uses no CPU. No disaggregation, no shared memory: the single-process setup
that tests use to run the HTTP app over the real engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from colocated.llm import check_request
from colocated.scheduler import ColocatedScheduler
from detokenizer.shard import DetokShard
from engine.config import EngineConfig
from engine.runner import ModelRunner
from frontend.engine_client import (
    EngineClient,
    EngineRequest,
    EngineUnavailable,
    Overloaded,
    WorkerHealth,
    WorkerMetrics,
)
from wire.records import DetokRegister, Finish, GenerateRequest, TextDelta

logger = logging.getLogger(__name__)


class LocalEngineClient(EngineClient):
    """In-process engine; ``max_active`` bounds admitted requests (beyond: ``Overloaded``)."""

    def __init__(self, config: EngineConfig, tokenizer: object, max_active: int = 256) -> None:
        self.runner = ModelRunner(config)
        self.scheduler = ColocatedScheduler(
            self.runner, 0, config.chunked_prefill_size, config.max_num_seqs
        )
        self.shard = DetokShard(tokenizer)
        self.max_active = max_active
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[int, asyncio.Queue[TextDelta]] = {}
        self._active: set[int] = set()  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-local-engine", daemon=True)
        self._thread.start()

    # -- event loop side -------------------------------------------------------------

    def check_admission(self) -> None:
        if len(self._streams) >= self.max_active:
            raise Overloaded(retry_after_s=1.0)

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        if not self._thread.is_alive():
            raise EngineUnavailable("the local engine thread has stopped")
        self.check_admission()
        self._loop = asyncio.get_running_loop()
        stream: asyncio.Queue[TextDelta] = asyncio.Queue()
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._streams[req.rid] = stream
        self._inbox.put(("add", (req, admitted)))
        try:
            await admitted  # admission errors surface here, before any delta
            while True:
                delta = await stream.get()
                yield delta
                if delta.finish:
                    return
        finally:
            self._streams.pop(req.rid, None)

    async def abort(self, rid: int) -> None:
        self._inbox.put(("abort", rid))

    def health(self) -> list[WorkerHealth]:
        s = self.scheduler
        load = {"running": float(s.num_running), "waiting": float(s.num_waiting)}
        return [WorkerHealth("local", 0, os.getpid(), self._thread.is_alive(), load)]

    def metrics_snapshot(self) -> list[WorkerMetrics]:
        alloc, s = self.runner.allocator, self.scheduler
        used = 1.0 - alloc.num_available / alloc.num_blocks if alloc.num_blocks else 0.0
        stats = alloc.stats
        return [WorkerMetrics("local", 0, s.num_running, s.num_waiting, used,
                              cached_blocks=alloc.num_hashed, prefix_hit_tokens=stats.hit_tokens,
                              prefix_queried_tokens=stats.queried_tokens)]  # fmt: skip

    async def close(self) -> None:
        self._inbox.put(("stop", None))
        await asyncio.to_thread(self._thread.join, 10)

    def _post(self, delta: TextDelta) -> None:
        stream = self._streams.get(delta.rid)
        if stream is not None:  # None: the consumer already left
            stream.put_nowait(delta)

    def _settle(self, fut: asyncio.Future[None], error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    # -- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain(block=not self._active):
                if self._active:
                    self._step()
        except Exception as e:
            logger.exception("local engine failed")
            self._fail_all(f"engine failure: {e}")

    def _drain(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        while True:
            try:
                kind, payload = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                req, fut = payload
                self._add(req, fut)
            elif kind == "abort":
                assert isinstance(payload, int)
                self._drop(payload)
                self.shard.abort(payload)
                self._publish()

    def _add(self, req: EngineRequest, fut: asyncio.Future[None]) -> None:
        assert self._loop is not None
        try:
            check_request(self.runner, req.prompt_ids, req.sampling)
        except Exception as e:  # prompt too long for the pool, bad params: refuse it
            logger.warning("rid=%d refused by the engine: %s", req.rid, e)
            self._loop.call_soon_threadsafe(self._settle, fut, EngineUnavailable(str(e)))
            return
        self.shard.register(DetokRegister(req.rid, req.detok, len(req.prompt_ids),
                                          req.num_logprobs))  # fmt: skip
        gen = GenerateRequest(req.rid, req.prompt_ids, req.sampling, decode_worker=0,
                              detok_shard=0, forks=req.forks, fork_of=req.fork_of)  # fmt: skip
        verdict = self.scheduler.add(gen)
        assert verdict == Finish.NONE, "check_request() let through what cannot fit"
        self._active.add(req.rid)
        self._loop.call_soon_threadsafe(self._settle, fut, None)

    def _drop(self, rid: int) -> None:
        if rid in self._active:
            self._active.discard(rid)
            self.scheduler.abort(rid)

    def _step(self) -> None:
        """One scheduler step; its tokens go through the detokenizer to the streams."""
        for _, batch in self.scheduler.step().tokens:
            for rid, finish in zip(batch.rids.tolist(), batch.finish.tolist()):
                if finish:
                    self._active.discard(rid)  # the scheduler already freed its blocks
            self.shard.on_tokens(batch, source_decode=0)
        self._publish()

    def _publish(self) -> None:
        batch, notify = self.shard.take_outputs()
        for _, stop in notify:  # a stop string matched: the engine must stop too
            self._drop(stop.rid)
        if batch is not None and self._loop is not None:
            for delta in batch.items:
                self._loop.call_soon_threadsafe(self._post, delta)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._active):
            self._drop(rid)
            delta = TextDelta(rid=rid, text="", token_ids=[], finish=int(Finish.ERROR),
                              error=message)  # fmt: skip
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._post, delta)
