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
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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
from transport.errors import PeerDead, RecordTooLarge
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
_WATCHDOG_S = 0.25  # a dead worker is noticed within this (plus the launcher's reaping)
_MAX_RESUMES = 3
_RESUME_PATIENCE_S = 20.0  # a restarting worker loads its model in this time on CPU
_RESUME_RID_BASE = 1 << 62


@dataclass
class _Stream:
    """One client request. ``rid`` changes when the request is resumed elsewhere."""

    req: EngineRequest
    queue: asyncio.Queue[TextDelta]
    rid: int
    placement: Placement
    shard: int
    token_ids: list[int] = field(default_factory=list)  # received so far, in order
    resumes: int = 0
    lost_since: float | None = None  # when a resume first failed for lack of capacity


class RingEngineClient(EngineClient):
    def __init__(self, spec: ProcessSpec, policy: str, router_config: RouterConfig) -> None:
        self.rings_in, self.rings_out, self.doorbell = attach_rings(spec)
        self.table, self._table_seg = load_table(spec)
        self.router = Router(self.table, policy, router_config)
        self.num_shards = len([n for n in self.rings_in if n.startswith("text.")])
        self.text_rings = [self.rings_in[f"text.k{k}"] for k in range(self.num_shards)]
        colocated = any(n.startswith("req.c") for n in self.rings_out)
        # Load-table roles of a placement's (prefill, decode) workers.
        self._roles = (Role.COLOCATED,) * 2 if colocated else (Role.PREFILL, Role.DECODE)
        self.streams: dict[int, _Stream] = {}  # by current rid
        self.by_origin: dict[int, _Stream] = {}  # by the rid the frontend gave the request
        # Resumed requests get fresh rids in a range the frontend never hands out.
        self._resume_rids = itertools.count(_RESUME_RID_BASE)
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
                    if stream is not None:  # else: a finished or superseded rid
                        stream.token_ids += delta.token_ids
                        stream.queue.put_nowait(delta)

    # ---- requests ----------------------------------------------------------------------

    def check_admission(self) -> None:
        try:
            self.router.check_capacity()
        except NoCapacity as e:
            raise Overloaded(e.retry_after_s, f"server overloaded: {e}") from e

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        self._start()
        try:
            placement = self.router.place(len(req.prompt_ids), req.sampling.max_tokens)
        except NoCapacity as e:
            raise Overloaded(e.retry_after_s, f"server overloaded: {e}") from e
        stream = _Stream(
            req, asyncio.Queue(), req.rid, placement, shard_for(req.rid, self.num_shards)
        )
        self.streams[req.rid] = self.by_origin[req.rid] = stream
        finished = submitted = False
        try:
            await self._submit(stream)
            submitted = True
            while True:
                delta = await stream.queue.get()
                finished = delta.finish != Finish.NONE
                yield delta
                if finished:
                    return
        finally:
            self.streams.pop(stream.rid, None)
            self.by_origin.pop(req.rid, None)
            if not finished:
                await self._abort(stream)
            # A request that never reached prefill must not count as sent to it.
            self.router.release(stream.placement, delivered=submitted)

    async def _submit(self, s: _Stream) -> None:
        """Register with the shard, then send to prefill (continuing after ``token_ids``)."""
        register = DetokRegister(
            rid=s.rid, params=s.req.detok, prompt_len=len(s.req.prompt_ids),
            num_logprobs=s.req.num_logprobs, output_ids=list(s.token_ids),
        )  # fmt: skip
        await self._put(self.rings_out[f"ctl.k{s.shard}"], register)
        gen = GenerateRequest(
            rid=s.rid, prompt_ids=s.req.prompt_ids, sampling=s.req.sampling,
            decode_worker=s.placement.decode, detok_shard=s.shard, output_ids=list(s.token_ids),
        )  # fmt: skip
        await self._put(self.rings_out[self._request_ring(s.placement)], gen)

    def _request_ring(self, p: Placement) -> str:
        """``req.p{i}``, or ``req.c{c}`` under ``launch --colocated`` (prefill == decode == c)."""
        colocated = f"req.c{p.prefill}"
        return colocated if colocated in self.rings_out else f"req.p{p.prefill}"

    async def _put(self, ring: Ring, msg: Control) -> None:
        """Publish without blocking the event loop; a ring full for long is an engine fault."""
        data = encode(msg)
        deadline = asyncio.get_running_loop().time() + _PUT_TIMEOUT_S
        while True:
            try:
                if ring.try_put(data):
                    return
            except PeerDead as e:
                raise EngineError(f"worker behind {ring.spec.tag} is gone") from e
            except RecordTooLarge as e:
                raise EngineError(f"request too large for {ring.spec.tag}: {e}") from e
            if not ring.peer_alive() or asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"worker behind {ring.spec.tag} is not taking requests")
            await asyncio.sleep(0.001)

    async def abort(self, rid: int) -> None:
        stream = self.by_origin.get(rid)
        if stream is not None:
            await self._abort(stream)

    async def _abort(self, s: _Stream) -> None:
        msg = AbortRequest(rid=s.rid)
        targets = [f"req.p{s.placement.prefill}", f"ctl.d{s.placement.decode}", f"ctl.k{s.shard}"]
        if f"req.c{s.placement.prefill}" in self.rings_out:  # co-located: one worker holds it
            targets = [f"req.c{s.placement.prefill}", f"ctl.k{s.shard}"]
        for name in targets:
            with contextlib.suppress(EngineError):
                await self._put(self.rings_out[name], msg)

    # ---- liveness and recovery ---------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCHDOG_S)
            try:
                await self._recover()
            except Exception:  # the watchdog must outlive any one bad recovery
                logger.exception("recovery pass failed")

    async def _recover(self) -> None:
        dead = self._dead_workers()
        for stream in list(self.streams.values()):
            if stream.lost_since is not None or self._lost(stream, dead):
                await self._resume(stream)

    def _lost(self, s: _Stream, dead: set[tuple[Role | None, int, int]]) -> bool:
        """Did a process this request depends on die?

        A dead prefill worker matters only before decode has produced anything: after
        that the request lives on its decode worker (a KV copy still in flight could read
        blocks the restarted prefill reuses, so one token is not yet safe). A co-located
        worker holds everything of its requests.
        """
        p, (p_role, d_role) = s.placement, self._roles
        if (d_role, p.decode, p.decode_generation) in dead or (None, s.shard, 0) in dead:
            return True
        early = len(s.token_ids) <= 1 or p_role == Role.COLOCATED
        return (p_role, p.prefill, p.prefill_generation) in dead and early

    async def _resume(self, s: _Stream) -> None:
        """Continue ``s`` under a fresh rid on live workers, from the tokens received.

        The old rid is aborted everywhere first, so whatever the dead worker's rings still
        hold for it is dropped. The new shard replays ``token_ids`` (emitting no text for
        them, keeping what it holds back), and prefill recomputes prompt + ``token_ids``:
        the client's stream continues with no lost and no duplicated text.
        """
        loop = asyncio.get_running_loop()
        if s.resumes >= _MAX_RESUMES:
            return self._fail(s, "request failed: its workers died repeatedly")
        try:
            placement = self.router.place(len(s.req.prompt_ids), s.req.sampling.max_tokens)
        except NoCapacity:
            s.lost_since = s.lost_since or loop.time()
            if loop.time() - s.lost_since > _RESUME_PATIENCE_S:
                self._fail(s, "request failed: no live worker to resume it on")
            return
        await self._abort(s)
        self.router.release(s.placement)
        del self.streams[s.rid]
        old = s.rid
        s.rid, s.placement, s.lost_since = next(self._resume_rids), placement, None
        s.shard = shard_for(s.rid, self.num_shards)
        s.resumes += 1
        self.streams[s.rid] = s
        logger.warning("rid %d: resumed as rid %d after %d tokens (prefill %d, decode %d)",
                       old, s.rid, len(s.token_ids), placement.prefill, placement.decode)  # fmt: skip
        try:
            await self._submit(s)
        except EngineError as e:
            self._fail(s, f"request failed while resuming: {e}")

    def _dead_workers(self) -> set[tuple[Role | None, int, int]]:
        dead: set[tuple[Role | None, int, int]] = set()
        live = {(r.role, r.index): r for r in self.table.snapshot()}
        for (role, index), row in live.items():
            if row.state == WorkerState.DEAD:
                dead.add((role, index, row.generation))
        p_role, d_role = self._roles
        for p in {s.placement for s in self.streams.values()}:
            for role, index, gen in ((p_role, p.prefill, p.prefill_generation),
                                     (d_role, p.decode, p.decode_generation)):  # fmt: skip
                now = live.get((role, index))
                if now is not None and now.generation != gen:
                    dead.add((role, index, gen))  # restarted since placement
        for k, ring in enumerate(self.text_rings):
            if not ring.peer_alive():
                dead.add((None, k, 0))
        return dead

    def _fail(self, s: _Stream, message: str) -> None:
        logger.error("rid %d: %s", s.rid, message)
        s.lost_since = None
        s.resumes = _MAX_RESUMES
        s.queue.put_nowait(
            TextDelta(rid=s.rid, text="", token_ids=[], finish=int(Finish.ERROR), error=message)
        )
        self.streams.pop(s.rid, None)

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
            active = sum(1 for st in self.streams.values() if st.shard == k)
            # A shard attaches its rings only once its tokenizer is loaded: pid 0 = starting.
            alive = ring.peer_alive() and ring.peer_pid != 0  # alive() refreshes the pid
            load = {"active_requests": float(active)}
            out.append(WorkerHealth("detokenizer", k, ring.peer_pid, alive, load))
        return out

    def metrics_snapshot(self) -> list[WorkerLoad]:
        out = []
        assigned = self.router.assigned()
        for r in self.table.snapshot():
            if r.role == Role.NONE:
                continue
            total = max(r.total_kv_blocks, 1)
            used = (r.total_kv_blocks - r.free_kv_blocks) / total
            n, tokens = assigned.get((r.role, r.index), (0, 0))
            out.append(WorkerLoad(r.role.name.lower(), r.index, r.running_requests,
                                  r.waiting_requests, used, n, tokens))  # fmt: skip
        return out

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._loop is not None:
            self._loop.remove_reader(self.doorbell.fileno())
