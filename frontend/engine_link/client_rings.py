"""The engine client of a launched server: workers reached over shared-memory rings.

Runs inside the frontend's event loop. A request's path:
    generate(): router.place() -> DetokRegister to its shard -> GenerateRequest to its
      prefill worker -> TextDeltas from the shard's text ring, via a per-request queue
    abort(): AbortRequest to the prefill worker, decode worker and shard of the request

Reading: the frontend's doorbell fd is registered with the event loop
(``loop.add_reader``). After each drain the client re-arms the doorbell (announces sleep
on every text ring, then re-checks), so a producer rings it only when the frontend is
actually waiting — no polling, no busy loop.

Worker deaths are ``frontend/engine_link/recovery.py``'s (a watchdog task started with the first
request); ``/health`` and ``/metrics`` views are ``frontend/engine_link/worker_status.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec

from detokenizer.routing import live_shard_for
from engine.kv.tiers.host_store import HostStore
from frontend.engine_link.board import FrontendBoard
from frontend.engine_link.engine_client import (
    EngineClient,
    EngineRequest,
    EngineUnavailable,
    Overloaded,
    WorkerHealth,
    WorkerReport,
)
from frontend.engine_link.lora_table import LoraTable
from frontend.engine_link.prefix_reset import ResetDone, reset_prefix_cache
from frontend.engine_link.recovery import (
    DEFAULT_MAX_REQUEST_RETRIES,
    DEFAULT_STALL_TIMEOUT_S,
    Recovery,
    Stream,
)
from frontend.engine_link.roles import RoleControl
from frontend.engine_link.worker_status import (
    frontend_health,
    restart_pending,
    shards_alive,
    worker_health,
    worker_metrics,
)
from router.router import NoCapacity, Placement, Router, RouterConfig
from router.tier_residency import TierResidency
from runtime.process import (
    ProcessSpec,
    attach_rings,
    load_table,
    prefix_summaries,
    shared_segment,
)
from transport.errors import PeerDead, RecordTooLarge
from transport.ring import Ring
from transport.role_table import RoleTable
from wire.records import (
    AbortRequest,
    Control,
    DetokRegister,
    Finish,
    GenerateRequest,
    TextBatch,
    TextDelta,
    UnloadLora,
    decode,
    encode,
)
from wire.ring_names import Peer, RingKind
from wire.roles import Role

logger = logging.getLogger(__name__)

_PUT_TIMEOUT_S = 5.0
_NO_SHARD_RETRY_S = 5.0  # a shard restarts in a few seconds
_RESTART_WAIT_S = 20.0  # a new request waits this long for a role's worker to restart


class RingEngineClient(EngineClient):
    def __init__(
        self,
        spec: ProcessSpec,
        policy: str,
        router_config: RouterConfig,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        node: str = "",
        remote_decode: Sequence[int] = (),
        slo_ms: tuple[float, float] | None = None,
        allow_role_override: bool = False,
        max_request_retries: int = DEFAULT_MAX_REQUEST_RETRIES,
    ) -> None:
        """``slo_ms``, ``allow_role_override``: ``launch --workers``' planner targets and
        test route (``frontend/engine_link/roles.py``)."""
        rings = attach_rings(spec)
        self.doorbell = rings.doorbell
        self.table, self._table_seg = load_table(spec)
        self.text_rings = list(rings.sources(RingKind.TEXT).values())  # by shard
        self.num_shards = len(self.text_rings)
        self.owner = spec.index
        self._board_seg = shared_segment(spec, "frontends")
        self.shared = (
            FrontendBoard(self._board_seg.buf, me=spec.index)
            if self._board_seg is not None
            else FrontendBoard.private(self.num_shards, self.table.num_workers)
        )
        self.shared.claim()
        self.board = self.shared
        self._lora_seg = shared_segment(spec, "loras")
        if self._lora_seg is not None:
            self.lora_table = LoraTable(self._lora_seg.spec.fd, self._lora_seg.buf)
        self._tier_seg = shared_segment(spec, "kvtier")
        residency = None
        self.kv_tier: HostStore | None = None  # emptied by reset_prefix_cache
        self.kv_tier_disk = False
        if self._tier_seg is not None:  # counters for /metrics, residency for the router
            tier = self.kv_tier = HostStore(self._tier_seg.spec.fd, self._tier_seg.buf)
            self.kv_tier_counters = tier.counters
            residency = tier_residency(tier, spec.segments["kvtier"], node)
            self.kv_tier_disk = bool(spec.segments["kvtier"].get("dir"))
        mapped = prefix_summaries(spec)  # each engine worker's; kept mapped with the client
        self._summary_segs = [seg for _, seg in mapped.values()]
        summaries = {_worker_key(name): summary for name, (summary, _) in mapped.items()}
        self._roles_seg = shared_segment(spec, "roles")  # launch --workers
        roles = None if self._roles_seg is None else RoleTable(self._roles_seg.buf)
        if roles is not None:
            self.role_control = RoleControl(roles, spec.index, slo_ms, allow_role_override)
        self.router = Router(
            self.table,
            policy,
            router_config,
            summaries,
            peers=self.shared,
            tiers=residency,
            roles=roles,
            owner=spec.index,
        )
        self.shard_ctl = rings.sinks(RingKind.CTL, Role.DETOK)
        self.decode_ctl = rings.sinks(RingKind.CTL, Role.DECODE)
        colocated = rings.sinks(RingKind.REQ, Role.COLOCATED)
        # Under ``launch --colocated`` a placement's prefill == decode == the worker c.
        self.req_rings = colocated or rings.sinks(RingKind.REQ, Role.PREFILL)
        self.expected_workers = (
            [(Role.COLOCATED, i) for i in colocated]
            if colocated
            else [(Role.PREFILL, i) for i in self.req_rings]
            + [(Role.DECODE, i) for i in self.decode_ctl]
        )
        self.streams: dict[int, Stream] = {}  # by current rid
        self.by_origin: dict[int, Stream] = {}  # by the rid the frontend gave the request
        self.recovery = Recovery(
            self, self.router, self.table, self.text_rings, stall_timeout_s, max_request_retries
        )
        self.stall_timeout_s = stall_timeout_s
        # Where /health and /metrics place each worker (frontend/engine_link/worker_status.py):
        # this frontend's node, and the decode workers other nodes bring (a head's reserve).
        self.node = node
        self.remote = frozenset((Role.DECODE, j) for j in remote_decode)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._planner: asyncio.Task[None] | None = None

    # ---- reading -----------------------------------------------------------------------

    def _start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.doorbell.fileno(), self._on_bell)
        self._watchdog = self._loop.create_task(self.recovery.watch())
        if self.role_control is not None and self.role_control.planner is not None:
            self._planner = self._loop.create_task(self.role_control.run(self.table))
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
                    if stream is None:  # a finished or superseded rid
                        continue
                    stream.token_ids += delta.token_ids
                    if delta.finish == Finish.LOST:
                        self._lost(stream, delta)
                    else:
                        stream.queue.put_nowait(delta)

    def _lost(self, stream: Stream, delta: TextDelta) -> None:
        """The engine lost ``stream`` (its KV could not be read): what came with the notice
        goes to the client, and recovery resumes the rest on its next pass."""
        if delta.text or delta.token_ids or delta.reasoning:
            stream.queue.put_nowait(msgspec.structs.replace(delta, finish=int(Finish.NONE)))
        if stream.lost_since is None:
            logger.warning(
                "rid %d: the engine lost it after %d tokens; resuming it",
                stream.rid,
                len(stream.token_ids),
            )
            stream.lost_since = time.monotonic()

    # ---- requests ----------------------------------------------------------------------

    def check_admission(self) -> None:
        if self._restart_pending():  # generate waits for it (``_admit``)
            return
        self._live_shard(0)
        try:
            self.router.check_capacity()
        except NoCapacity as e:
            raise Overloaded(e.retry_after_s, f"server overloaded: {e}") from e

    def _restart_pending(self) -> bool:
        return restart_pending(self.table, self.text_rings, self.shared)

    async def _admit(self, req: EngineRequest) -> tuple[int, Placement]:
        """The shard and placement of a new request. While a role has no live worker (or
        no shard lives) but one is being restarted, the request waits for it, up to
        ``_RESTART_WAIT_S``, as a resumed request does, rather than getting a 503: a
        killed worker is back in seconds. Busy workers are answered at once."""
        until = time.monotonic() + _RESTART_WAIT_S
        while True:
            try:
                shard = self._live_shard(req.rid)
                return shard, self._place(req)
            except (NoCapacity, Overloaded) as e:
                down = isinstance(e, Overloaded) or e.reason.startswith("no live")
                if not down or time.monotonic() > until or not self._restart_pending():
                    if isinstance(e, Overloaded):
                        raise
                    raise Overloaded(e.retry_after_s, f"server overloaded: {e}") from e
            await asyncio.sleep(0.1)

    def _live_shard(self, rid: int) -> int:
        """The shard for a new request; ``Overloaded`` (503) while none is alive."""
        shard = live_shard_for(rid, shards_alive(self.text_rings))
        if shard is None:
            raise Overloaded(_NO_SHARD_RETRY_S, "no detokenizer shard is running")
        return shard

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        self._start()
        shard, placement = await self._admit(req)
        stream = Stream(req, asyncio.Queue(), req.rid, placement, shard)
        self.streams[req.rid] = self.by_origin[req.rid] = stream
        finished = submitted = False
        arrived, first_at = time.monotonic(), None  # the planner's TTFT and TPOT
        try:
            await self.submit(stream)
            submitted = True
            while True:
                delta = await stream.queue.get()
                if first_at is None and delta.token_ids:
                    first_at = time.monotonic()
                finished = delta.finish != Finish.NONE
                if finished and self.role_control is not None:
                    self.role_control.observe(arrived, first_at, len(stream.token_ids))
                yield delta
                if finished:
                    return
        finally:
            self.streams.pop(stream.rid, None)
            self.by_origin.pop(req.rid, None)
            if not finished:
                await self.abort_everywhere(stream)
            # A request that never reached prefill must not count as sent to it.
            self.router.release(stream.placement, delivered=submitted)

    def _place(self, req: EngineRequest) -> Placement:
        """A fork (``n > 1``) goes to its leader's prefill worker if that one can take it."""
        lora = req.sampling.lora
        # Once per request (cache-aware); salted as the workers salt an adapter's blocks.
        hashes = self.router.hash_blocks(req.prompt_ids, None if lora is None else lora.salt)
        fp = None if lora is None else lora.fingerprint
        leader = self.by_origin.get(req.fork_of) if req.fork_of >= 0 else None
        if leader is not None and not leader.resumes:
            try:
                prefill = leader.placement.prefill
                return self.router.place(
                    len(req.prompt_ids), req.sampling.max_tokens, hashes, prefill=prefill, lora=fp
                )
            except NoCapacity:
                pass  # it runs as an ordinary request, wherever the router puts it
        return self.router.place(len(req.prompt_ids), req.sampling.max_tokens, hashes, lora=fp)

    async def submit(self, s: Stream) -> None:
        """Register with the shard, then send to prefill (continuing after ``token_ids``)."""
        register = DetokRegister(
            rid=s.rid,
            params=s.req.detok,
            prompt_len=len(s.req.prompt_ids),
            num_logprobs=s.req.num_logprobs,
            output_ids=list(s.token_ids),
        )
        await self._put(self.shard_ctl[s.shard], register)
        first = not s.resumes  # a resumed choice has output of its own: nothing to share
        gen = GenerateRequest(
            rid=s.rid,
            prompt_ids=s.req.prompt_ids,
            sampling=s.req.sampling,
            decode_worker=s.placement.decode,
            detok_shard=s.shard,
            output_ids=list(s.token_ids),
            forks=s.req.forks if first else 0,
            fork_of=s.req.fork_of if first else -1,
        )
        await self._put(self.req_rings[s.placement.prefill], gen)

    def poisoned(self, pids: list[int]) -> None:
        """Recovery ended a request as poison: the launcher is told which deaths it
        explains (not counted towards those workers' crash loops), /metrics counts it."""
        self.shared.explain_deaths(pids)
        if self.on_poisoned is not None:
            self.on_poisoned()

    async def reset_prefix_cache(self) -> ResetDone:
        """Empty every pool's prefix cache and the host tiers (``prefix_reset.py``)."""
        rings = [*self.req_rings.values(), *self.decode_ctl.values()]
        return await reset_prefix_cache(
            rings, self._put, self.table, self.node, self.kv_tier, self.kv_tier_disk
        )

    async def unload_lora(self, fingerprint: str) -> None:
        """``UnloadLora`` to every engine worker, on the rings requests and aborts take; a
        worker that is gone restarts without any adapter."""
        self.router.adapters.forget(fingerprint)
        msg = UnloadLora(fingerprint)
        for ring in [*self.req_rings.values(), *self.decode_ctl.values()]:
            with contextlib.suppress(EngineUnavailable):
                await self._put(ring, msg)

    async def _put(self, ring: Ring, msg: Control) -> None:
        """Publish without blocking the event loop; a ring full for long is an engine fault."""
        data = encode(msg)
        deadline = asyncio.get_running_loop().time() + _PUT_TIMEOUT_S
        while True:
            try:
                if ring.try_put(data):
                    return
            except PeerDead as e:
                raise EngineUnavailable(f"worker behind {ring.spec.tag} is gone") from e
            except RecordTooLarge as e:
                raise EngineUnavailable(f"request too large for {ring.spec.tag}: {e}") from e
            if not ring.peer_alive() or asyncio.get_running_loop().time() > deadline:
                raise EngineUnavailable(f"worker behind {ring.spec.tag} is not taking requests")
            await asyncio.sleep(0.001)

    async def abort(self, rid: int) -> None:
        stream = self.by_origin.get(rid)
        if stream is not None:
            await self.abort_everywhere(stream)

    async def abort_everywhere(self, s: Stream) -> None:
        """AbortRequest to every process that may hold ``s`` (a co-located worker is one)."""
        msg = AbortRequest(rid=s.rid)
        targets = [self.req_rings[s.placement.prefill], self.shard_ctl[s.shard]]
        if self.decode_ctl:
            targets.append(self.decode_ctl[s.placement.decode])
        elif s.placement.decode != s.placement.prefill:  # --workers: a handoff's decoder
            targets.append(self.req_rings[s.placement.decode])
        for ring in targets:
            with contextlib.suppress(EngineUnavailable):
                await self._put(ring, msg)

    # ---- observation -------------------------------------------------------------------

    def health(self) -> list[WorkerHealth]:
        """The same from every frontend: shard loads are every frontend's, summed."""
        mine = [0] * self.num_shards
        for st in self.streams.values():
            mine[st.shard] += 1
        self.shared.set_active(mine)
        active = dict(enumerate(self.shared.active_per_shard()))
        workers = worker_health(
            self.table,
            self.expected_workers,
            self.text_rings,
            active,
            self.stall_timeout_s / 4,
            node=self.node,
            remote=self.remote,
            board=self.shared,
        )
        if self.role_control is not None:  # launch --workers: each worker's role now
            roles = self.role_control.serving_roles()
            workers = [
                replace(w, serving_role=roles.get(w.index)) if w.role == "colocated" else w
                for w in workers
            ]
        return workers + frontend_health(self.shared, node=self.node)

    def metrics_snapshot(self) -> list[WorkerReport]:
        return worker_metrics(
            self.table, self.router.assigned(), node=self.node, remote=self.remote
        )

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._planner is not None:
            self._planner.cancel()
        if self._loop is not None:
            self._loop.remove_reader(self.doorbell.fileno())


def tier_residency(tier: HostStore, fields: dict[str, Any], node: str) -> TierResidency:
    """The router's view of the host tiers (their blocks' namespace is in ``tier``)."""
    disk = fields.get("dir")
    return TierResidency(tier, None if disk is None else Path(disk), node)


def _worker_key(name: str) -> tuple[Role, int]:
    """A summary's peer name (``p0``, ``d1``, ``c2``) -> the router's (role, index)."""
    peer = Peer.parse(name)
    return peer.role, peer.index
