"""``LocalEngineClient``: the project's engine and detokenizer in this process.

One engine thread owns an ``engine.llm.LLM`` (model runner + continuous-batching step)
and a ``detokenizer.shard.DetokShard``. The event loop talks to it through a queue and
gets ``TextDelta``s back with ``call_soon_threadsafe``; the thread blocks on its inbox
when no request is active, so an idle client uses no CPU. No disaggregation, no shared
memory: this is the single-process setup used by tests and the co-located baseline.

NOTE: ``LLM`` exposes only run-to-completion ``generate``; streaming needs its per-step
scheduler, so this client drives ``LLM._admit`` and ``LLM._step`` (see the report).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from detokenizer.shard import DetokShard
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sequence import Sequence
from frontend.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    Overloaded,
    WorkerHealth,
    WorkerLoad,
)
from transport.records import DetokRegister, Finish, TextDelta, TokenBatch

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    seq: Sequence
    sent: int = 0  # output tokens already handed to the detokenizer


class LocalEngineClient(EngineClient):
    """In-process engine; ``max_active`` bounds admitted requests (beyond: ``Overloaded``)."""

    def __init__(self, config: EngineConfig, tokenizer: object, max_active: int = 256) -> None:
        self.llm = LLM(config)
        self.shard = DetokShard(tokenizer)
        self.max_active = max_active
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[int, asyncio.Queue[TextDelta]] = {}
        self._active: dict[int, _Active] = {}  # engine thread only
        self._waiting: deque[Sequence] = deque()  # engine thread only
        self._running: list[Sequence] = []  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-local-engine", daemon=True)
        self._thread.start()

    # -- event loop side -------------------------------------------------------------

    def check_admission(self) -> None:
        if len(self._streams) >= self.max_active:
            raise Overloaded(retry_after_s=1.0)

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        if not self._thread.is_alive():
            raise EngineError("the local engine thread has stopped")
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
        load = {"running": float(len(self._running)), "waiting": float(len(self._waiting))}
        return [WorkerHealth("local", 0, os.getpid(), self._thread.is_alive(), load)]

    def metrics_snapshot(self) -> list[WorkerLoad]:
        alloc = self.llm.runner.allocator
        used = 1.0 - alloc.num_available / alloc.num_blocks if alloc.num_blocks else 0.0
        return [WorkerLoad("local", 0, len(self._running), len(self._waiting), used)]

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
                    self.llm._step(self._waiting, self._running)
                    self._emit()
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
            seq = self.llm._admit(req.prompt_ids, req.sampling)
        except Exception as e:  # prompt too long for the pool, bad params: refuse it
            logger.warning("rid=%d refused by the engine: %s", req.rid, e)
            self._loop.call_soon_threadsafe(self._settle, fut, EngineError(str(e)))
            return
        seq.rid = req.rid
        self.shard.register(DetokRegister(req.rid, req.detok, len(req.prompt_ids),
                                          req.num_logprobs))  # fmt: skip
        self._active[req.rid] = _Active(seq)
        self._waiting.append(seq)
        self._loop.call_soon_threadsafe(self._settle, fut, None)

    def _drop(self, rid: int) -> None:
        entry = self._active.pop(rid, None)
        if entry is None:
            return
        if entry.seq in self._running:
            self._running.remove(entry.seq)
        if entry.seq in self._waiting:
            self._waiting.remove(entry.seq)
        self.llm.runner.free_blocks(entry.seq)

    def _emit(self) -> None:
        """Hand this step's new tokens to the detokenizer; publish its text."""
        rows: list[tuple[int, int, int, float, int, list[tuple[int, float]]]] = []
        for rid, entry in list(self._active.items()):
            seq = entry.seq
            for pos in range(entry.sent, len(seq.output_ids)):
                last = pos == len(seq.output_ids) - 1
                lp = seq.logprobs[pos] if seq.sampling.logprobs is not None else float("nan")
                top = seq.top_logprobs[pos] if seq.sampling.logprobs else []
                rows.append((rid, pos, seq.output_ids[pos], lp,
                             int(seq.finish) if last else 0, top))  # fmt: skip
            entry.sent = len(seq.output_ids)
            if seq.finish != Finish.NONE:
                del self._active[rid]  # LLM already freed its blocks
        if rows:
            self.shard.on_tokens(_token_batch(rows), source_decode=0)
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


def _token_batch(
    rows: list[tuple[int, int, int, float, int, list[tuple[int, float]]]],
) -> TokenBatch:
    k = max(len(r[5]) for r in rows)
    top_ids = np.zeros((len(rows), k), np.int32)  # (B, K); short rows padded, ignored
    top_lps = np.full((len(rows), k), -np.inf, np.float32)
    for i, r in enumerate(rows):
        for j, (tid, lp) in enumerate(r[5]):
            top_ids[i, j], top_lps[i, j] = tid, lp
    rids, positions, tokens, lps, finish, _ = zip(*rows)
    return TokenBatch.build(list(rids), list(positions), list(tokens), list(lps), list(finish),
                            top_ids, top_lps)  # fmt: skip
