"""Recovery of requests whose workers died: the frontend's watchdog.

Twice a second (``WATCHDOG_S``) it reads the load table and the text rings' peers. A
request whose decode worker, detokenizer shard or (before decode produced anything)
prefill worker is dead — DEAD in the table, or restarted since the request was placed —
is resumed: the old rid is aborted everywhere, the request gets a fresh rid, a fresh
placement and a shard, and prefill recomputes prompt + the tokens already streamed. The
client's stream continues with no lost and no duplicated text.

A request that cannot be placed again keeps trying for ``RESUME_PATIENCE_S`` (a restarting
worker loads its model in that time on CPU); one resumed ``MAX_RESUMES`` times ends with
``finish = ERROR`` and a message, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from detokenizer.routing import shard_for
from frontend.engine_client import EngineRequest, EngineUnavailable
from router.router import NoCapacity, Placement, Router
from transport.load_table import LoadTable, Role, WorkerState
from transport.ring import Ring
from wire.records import Finish, TextDelta

logger = logging.getLogger(__name__)

WATCHDOG_S = 0.25  # a dead worker is noticed within this (plus the launcher's reaping)
MAX_RESUMES = 3
RESUME_PATIENCE_S = 20.0
RESUME_RID_BASE = 1 << 62  # resumed requests get rids the frontend never hands out

# (role, index, generation) of a dead process; a dead shard is (None, k, 0).
DeadSet = set[tuple[Role | None, int, int]]


@dataclass
class Stream:
    """One client request. ``rid`` changes when the request is resumed elsewhere."""

    req: EngineRequest
    queue: asyncio.Queue[TextDelta]
    rid: int
    placement: Placement
    shard: int
    token_ids: list[int] = field(default_factory=list)  # received so far, in order
    resumes: int = 0
    lost_since: float | None = None  # when a resume first failed for lack of capacity


class Resubmitter(Protocol):
    """What recovery needs of the engine client: its streams and the way to (re)send."""

    streams: dict[int, Stream]  # by current rid

    async def submit(self, s: Stream) -> None: ...
    async def abort_everywhere(self, s: Stream) -> None: ...


class Recovery:
    def __init__(
        self, client: Resubmitter, router: Router, table: LoadTable, text_rings: Sequence[Ring]
    ) -> None:
        self.client, self.router, self.table = client, router, table
        self.text_rings = text_rings
        self._rids = itertools.count(RESUME_RID_BASE)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            try:
                await self.recover()
            except Exception:  # the watchdog must outlive any one bad recovery
                logger.exception("recovery pass failed")

    async def recover(self) -> None:
        dead = self._dead_workers()
        for stream in list(self.client.streams.values()):
            if stream.lost_since is not None or self._lost(stream, dead):
                await self._resume(stream)

    def _lost(self, s: Stream, dead: DeadSet) -> bool:
        """Did a process this request depends on die?

        A dead prefill worker matters only before decode has produced anything: after
        that the request lives on its decode worker (a KV copy still in flight could read
        blocks the restarted prefill reuses, so one token is not yet safe). A co-located
        worker holds everything of its requests.
        """
        p = s.placement
        (p_role, _), (d_role, _) = p.keys
        if (d_role, p.decode, p.decode_generation) in dead or (None, s.shard, 0) in dead:
            return True
        early = len(s.token_ids) <= 1 or p.colocated
        return (p_role, p.prefill, p.prefill_generation) in dead and early

    async def _resume(self, s: Stream) -> None:
        """Continue ``s`` under a fresh rid on live workers, from the tokens received.

        The old rid is aborted everywhere first, so whatever the dead worker's rings still
        hold for it is dropped. The new shard replays ``token_ids`` (emitting no text for
        them, keeping what it holds back), and prefill recomputes prompt + ``token_ids``.
        """
        loop = asyncio.get_running_loop()
        if s.resumes >= MAX_RESUMES:
            return self.fail(s, "request failed: its workers died repeatedly")
        try:
            placement = self.router.place(len(s.req.prompt_ids), s.req.sampling.max_tokens)
        except NoCapacity:
            s.lost_since = s.lost_since or loop.time()
            if loop.time() - s.lost_since > RESUME_PATIENCE_S:
                self.fail(s, "request failed: no live worker to resume it on")
            return
        streams = self.client.streams
        await self.client.abort_everywhere(s)
        self.router.release(s.placement)
        del streams[s.rid]
        old = s.rid
        s.rid, s.placement, s.lost_since = next(self._rids), placement, None
        s.shard = shard_for(s.rid, len(self.text_rings))
        s.resumes += 1
        streams[s.rid] = s
        logger.warning("rid %d: resumed as rid %d after %d tokens (prefill %d, decode %d)",
                       old, s.rid, len(s.token_ids), placement.prefill, placement.decode)  # fmt: skip
        try:
            await self.client.submit(s)
        except EngineUnavailable as e:
            self.fail(s, f"request failed while resuming: {e}")

    def _dead_workers(self) -> DeadSet:
        dead: DeadSet = set()
        live = {(r.role, r.index): r for r in self.table.snapshot()}
        for (role, index), row in live.items():
            if row.state == WorkerState.DEAD:
                dead.add((role, index, row.generation))
        for p in {s.placement for s in self.client.streams.values()}:
            p_key, d_key = p.keys
            for (role, index), gen in ((p_key, p.prefill_generation),
                                       (d_key, p.decode_generation)):  # fmt: skip
                now = live.get((role, index))
                if now is not None and now.generation != gen:
                    dead.add((role, index, gen))  # restarted since placement
        for k, ring in enumerate(self.text_rings):
            if not ring.peer_alive():
                dead.add((None, k, 0))
        return dead

    def fail(self, s: Stream, message: str) -> None:
        """End ``s`` with ``finish = ERROR`` and ``message``; it is never resumed again."""
        logger.error("rid %d: %s", s.rid, message)
        s.lost_since = None
        s.resumes = MAX_RESUMES
        s.queue.put_nowait(
            TextDelta(rid=s.rid, text="", token_ids=[], finish=int(Finish.ERROR), error=message)
        )
        self.client.streams.pop(s.rid, None)
