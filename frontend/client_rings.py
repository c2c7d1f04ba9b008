"""The engine client of a launched server: workers reached over shared-memory rings.

Runs inside the frontend's event loop. A request's path:
    generate(): router.place() -> DetokRegister to its shard -> GenerateRequest to its
      prefill worker -> TextDeltas from the shard's text ring, via a per-request queue
    abort(): AbortRequest to the prefill worker, decode worker and shard of the request

Reading: the frontend's doorbell fd is registered with the event loop
(``loop.add_reader``). After each drain the client re-arms the doorbell (announces sleep
on every text ring, then re-checks), so a producer rings it only when the frontend is
actually waiting — no polling, no busy loop.

Liveness: a watchdog task looks at the load table and the text rings twice a second; a
request whose prefill or decode worker (that generation) or detokenizer shard died ends
with ``finish = ERROR`` and a message instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from detokenizer.routing import shard_for
from frontend.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    Overloaded,
    WorkerHealth,
    WorkerLoad,
)
from pdserve.process import ProcessSpec, attach_rings, load_table
from router.load_table import Role, WorkerState
from router.policy import NoCapacity, Placement, Router, RouterConfig
from transport.records import (
    AbortRequest,
    Control,
    DetokRegister,
    Finish,
    GenerateRequest,
    TextBatch,
    TextDelta,
    decode,
    encode,
)
from transport.ring import Ring

logger = logging.getLogger(__name__)

_PUT_TIMEOUT_S = 5.0
_WATCHDOG_S = 0.5


@dataclass
class _Stream:
    queue: asyncio.Queue[TextDelta]
    placement: Placement
    shard: int


class RingEngineClient(EngineClient):
    def __init__(self, spec: ProcessSpec, policy: str, router_config: RouterConfig) -> None:
        self.rings_in, self.rings_out, self.doorbell = attach_rings(spec)
        self.table, self._table_seg = load_table(spec)
        self.router = Router(self.table, policy, router_config)
        self.num_shards = len([n for n in self.rings_in if n.startswith("text.")])
        self.text_rings = [self.rings_in[f"text.k{k}"] for k in range(self.num_shards)]
        self.streams: dict[int, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None

    # ---- reading -----------------------------------------------------------------------

    def _start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.doorbell.fileno(), self._on_bell)
        self._watchdog = self._loop.create_task(self._watch())
        self._on_bell()

    def _on_bell(self) -> None:
        self.doorbell.clear()
        self._drain()
        if self.doorbell.arm(self.text_rings):
            assert self._loop is not None
            self._loop.call_soon(self._on_bell)  # data raced in while arming

    def _drain(self) -> None:
        for ring in self.text_rings:
            for raw in ring.drain(1024):
                msg = decode(raw)
                if not isinstance(msg, TextBatch):
                    logger.error("unexpected record %s on %s", type(msg), ring.spec.tag)
                    continue
                for delta in msg.items:
                    stream = self.streams.get(delta.rid)
                    if stream is not None:
                        stream.queue.put_nowait(delta)

    # ---- requests ----------------------------------------------------------------------

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        self._start()
        try:
            placement = self.router.place(len(req.prompt_ids), req.sampling.max_tokens)
        except NoCapacity as e:
            raise Overloaded(e.retry_after_s, f"server overloaded: {e}") from e
        shard = shard_for(req.rid, self.num_shards)
        stream = _Stream(asyncio.Queue(), placement, shard)
        self.streams[req.rid] = stream
        finished = False
        try:
            await self._submit(req, placement, shard)
            while True:
                delta = await stream.queue.get()
                finished = delta.finish != Finish.NONE
                yield delta
                if finished:
                    return
        finally:
            self.streams.pop(req.rid, None)
            if not finished:
                await self._abort(req.rid, placement, shard)
            self.router.release(placement)

    async def _submit(self, req: EngineRequest, placement: Placement, shard: int) -> None:
        register = DetokRegister(
            rid=req.rid, params=req.detok, prompt_len=len(req.prompt_ids),
            num_logprobs=req.num_logprobs,
        )  # fmt: skip
        await self._put(self.rings_out[f"ctl.k{shard}"], register)
        gen = GenerateRequest(
            rid=req.rid, prompt_ids=req.prompt_ids, sampling=req.sampling,
            decode_worker=placement.decode, detok_shard=shard,
        )  # fmt: skip
        await self._put(self.rings_out[f"req.p{placement.prefill}"], gen)

    async def _put(self, ring: Ring, msg: Control) -> None:
        """Publish without blocking the event loop; a ring full for long is an engine fault."""
        data = encode(msg)
        deadline = asyncio.get_running_loop().time() + _PUT_TIMEOUT_S
        while not ring.try_put(data):
            if not ring.peer_alive() or asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"worker behind {ring.spec.tag} is not taking requests")
            await asyncio.sleep(0.001)

    async def abort(self, rid: int) -> None:
        stream = self.streams.get(rid)
        if stream is not None:
            await self._abort(rid, stream.placement, stream.shard)

    async def _abort(self, rid: int, placement: Placement, shard: int) -> None:
        msg = AbortRequest(rid=rid)
        targets = [f"req.p{placement.prefill}", f"ctl.d{placement.decode}", f"ctl.k{shard}"]
        for name in targets:
            with contextlib.suppress(EngineError):
                await self._put(self.rings_out[name], msg)

    # ---- liveness ----------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCHDOG_S)
            dead = self._dead_workers()
            for rid, stream in list(self.streams.items()):
                p = stream.placement
                lost = {
                    (Role.PREFILL, p.prefill, p.prefill_generation),
                    (Role.DECODE, p.decode, p.decode_generation),
                    (None, stream.shard, 0),
                } & dead
                if lost:
                    self._fail(rid, stream, "a worker serving this request died")

    def _dead_workers(self) -> set[tuple[Role | None, int, int]]:
        dead: set[tuple[Role | None, int, int]] = set()
        live = {(r.role, r.index): r for r in self.table.snapshot()}
        for (role, index), row in live.items():
            if row.state == WorkerState.DEAD:
                dead.add((role, index, row.generation))
        for p in {s.placement for s in self.streams.values()}:
            for role, index, gen in ((Role.PREFILL, p.prefill, p.prefill_generation),
                                     (Role.DECODE, p.decode, p.decode_generation)):  # fmt: skip
                now = live.get((role, index))
                if now is not None and now.generation != gen:
                    dead.add((role, index, gen))  # restarted since placement
        for k, ring in enumerate(self.text_rings):
            if not ring.peer_alive():
                dead.add((None, k, 0))
        return dead

    def _fail(self, rid: int, stream: _Stream, message: str) -> None:
        logger.error("rid %d: %s", rid, message)
        stream.queue.put_nowait(
            TextDelta(rid=rid, text="", token_ids=[], finish=int(Finish.ERROR), error=message)
        )

    # ---- observation -------------------------------------------------------------------

    def health(self) -> list[WorkerHealth]:
        out = []
        for r in self.table.snapshot():
            if r.role == Role.NONE:
                continue
            alive = r.state == WorkerState.READY  # a (re)starting worker is not serving yet
            load = {
                "queued_prefill_tokens": float(r.queued_prefill_tokens),
                "waiting_requests": float(r.waiting_requests),
                "running_requests": float(r.running_requests),
                "free_kv_blocks": float(r.free_kv_blocks),
                "total_kv_blocks": float(r.total_kv_blocks),
            }
            out.append(WorkerHealth(r.role.name.lower(), r.index, r.pid, alive, load))
        for k, ring in enumerate(self.text_rings):
            active = sum(1 for s in self.streams.values() if s.shard == k)
            # A shard attaches its rings only once its tokenizer is loaded: pid 0 = starting.
            alive = ring.peer_alive() and ring.peer_pid != 0  # alive() refreshes the pid
            load = {"active_requests": float(active)}
            out.append(WorkerHealth("detokenizer", k, ring.peer_pid, alive, load))
        return out

    def metrics_snapshot(self) -> list[WorkerLoad]:
        out = []
        for r in self.table.snapshot():
            if r.role == Role.NONE:
                continue
            total = max(r.total_kv_blocks, 1)
            used = (r.total_kv_blocks - r.free_kv_blocks) / total
            out.append(WorkerLoad(r.role.name.lower(), r.index, r.running_requests,
                                  r.waiting_requests, used))  # fmt: skip
        return out

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._loop is not None:
            self._loop.remove_reader(self.doorbell.fileno())
