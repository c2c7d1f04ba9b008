"""Recovery of requests whose workers died or stalled: the frontend's watchdog.

Every ``WATCHDOG_S`` it reads the load table and the text rings' peers. A request is
lost when a process it depends on is gone: its decode worker, its detokenizer shard, or
(before decode produced anything) its prefill worker is DEAD or FAILED in the table,
restarted since the request was placed, or stalled — READY but with no heartbeat for
``stall_timeout_s`` (a stopped or wedged process; a live worker publishes every step and
at least every 0.4 s while idle). A decode worker that could not read a request's KV
(its prefill host died or is cut off) says so itself, with a ``Finish.LOST`` row: the
request is lost from then on, whoever noticed first. A lost request is resumed: the old rid is aborted
everywhere, the request gets a fresh rid, a fresh placement and a live shard, and prefill
recomputes prompt + the tokens already streamed. The client's stream continues with no
lost and no duplicated text; a stalled worker that wakes up finds its rids aborted.

When nothing can take the request yet (every shard or every worker of a role restarting),
it is retried with back-off (``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``) for
``RESUME_WINDOW_S`` — long enough for a worker to restart and load its model — and only
then ends with ``finish = ERROR`` and a message, never a hang. A request resumed
``MAX_RESUMES`` times ends the same way: its workers keep dying under it.

Poison (``frontend/engine_link/poison.py``): a death is blamed on the requests that had
just been given to the dead worker; one blamed for more than ``max_retries`` deaths is
ended as poison, its deaths are reported to the launcher as explained (``explain``), and
a request on its last chance re-enters alone (``_may_resume``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from detokenizer.routing import live_shard_for
from frontend.engine_link.engine_client import EngineRequest, EngineUnavailable
from frontend.engine_link.poison import (
    Death,
    Strikes,
    explained_pids,
    last_chance,
    poison_message,
    record_death,
)
from frontend.engine_link.worker_status import shards_alive
from router.router import NoCapacity, Placement, Router
from transport.load_table import LoadTable, WorkerState, describe_exit
from transport.ring import Ring
from wire.records import Finish, TextDelta
from wire.roles import Role

logger = logging.getLogger(__name__)

WATCHDOG_S = 0.25  # a dead worker is noticed within this (plus the launcher's reaping)
MAX_RESUMES = 8
RESUME_WINDOW_S = 60.0
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 4.0
DEFAULT_STALL_TIMEOUT_S = 20.0
DEFAULT_MAX_REQUEST_RETRIES = 1  # resumes after deaths a request is blamed for

# (role, index, generation) of a dead or stalled process -> how it died; a dead shard is
# (None, k, 0).
DeadSet = dict[tuple[Role | None, int, int], Death]


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
    lost_since: float | None = None  # monotonic time it was found lost and not yet resumed
    retry_at: float = 0.0  # no resume attempt before this (back-off)
    strikes: Strikes = field(default_factory=Strikes)  # deaths it was present at


class Resubmitter(Protocol):
    """What recovery needs of the engine client: its streams and the way to (re)send."""

    streams: dict[int, Stream]  # by current rid

    def next_rid(self) -> int: ...
    async def submit(self, s: Stream) -> None: ...
    async def abort_everywhere(self, s: Stream) -> None: ...
    def poisoned(self, pids: list[int]) -> None:
        """A request was ended as poison; the deaths of ``pids`` are explained by it."""


def stalled(row_heartbeat_ns: int, now_ns: int, timeout_s: float) -> bool:
    return now_ns - row_heartbeat_ns > timeout_s * 1e9


class Recovery:
    def __init__(
        self,
        client: Resubmitter,
        router: Router,
        table: LoadTable,
        text_rings: Sequence[Ring],
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_REQUEST_RETRIES,
    ) -> None:
        self.client, self.router, self.table = client, router, table
        self.text_rings = text_rings
        self.stall_timeout_s = stall_timeout_s
        self.max_retries = max_retries
        self._probation: Stream | None = None  # the last-chance request now re-entering

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            try:
                await self.recover()
            except Exception:  # the watchdog must outlive any one bad recovery
                logger.exception("recovery pass failed")

    async def recover(self) -> None:
        dead = self._dead_workers()
        now = time.monotonic()
        for stream in list(self.client.streams.values()):
            if stream.lost_since is None:
                death = self._lost(stream, dead)
                if death is not None and self._poisoned(stream, death):
                    continue
                if death is not None:
                    stream.lost_since = now
            if stream.lost_since is not None and now >= stream.retry_at:
                await self._resume(stream, now)

    def _poisoned(self, s: Stream, death: Death) -> bool:
        """Count ``death`` against ``s``; end it as poison if that was one too many."""
        if not record_death(s.strikes, death, len(s.token_ids), self.max_retries):
            return False
        message = poison_message(s.strikes)
        # The one log line naming it (never its body): whoever sent it can be found.
        logger.error("rid %d: ended as a poison request: %s", s.rid, message)
        self.fail(s, message, log=False)
        self.client.poisoned(explained_pids(s.strikes))
        return True

    def _may_resume(self, s: Stream) -> bool:
        """A last-chance request re-enters only while no other is fresh on its workers."""
        if not last_chance(s.strikes, self.max_retries):
            return True
        h = self._probation
        if (
            h is not None
            and h is not s
            and self.client.streams.get(h.rid) is h
            and (h.lost_since is not None or h.strikes.fresh(len(h.token_ids)))
        ):
            return False
        self._probation = s
        return True

    def _lost(self, s: Stream, dead: DeadSet) -> Death | None:
        """Did a process this request depends on die (or stall)?

        A dead prefill worker matters only before decode has produced anything: after
        that the request lives on its decode worker (a KV copy still in flight could read
        blocks the restarted prefill reuses, so one token is not yet safe). A co-located
        worker holds everything of its requests.
        """
        p = s.placement
        (p_role, _), (d_role, _) = p.keys
        death = dead.get((d_role, p.decode, p.decode_generation)) or dead.get((None, s.shard, 0))
        if death is not None:
            return death
        early = len(s.token_ids) <= 1 or p.colocated
        return dead.get((p_role, p.prefill, p.prefill_generation)) if early else None

    async def _resume(self, s: Stream, now: float) -> None:
        """Continue ``s`` under a fresh rid on live workers, from the tokens received.

        The old rid is aborted everywhere first, so whatever the dead worker's rings still
        hold for it is dropped. The new shard replays ``token_ids`` (emitting no text for
        them, keeping what it holds back), and prefill recomputes prompt + ``token_ids``.
        """
        assert s.lost_since is not None
        if s.resumes >= MAX_RESUMES:
            return self.fail(s, "request failed: its workers died repeatedly")
        if not self._may_resume(s):  # its turn comes: not a wait for capacity
            s.lost_since, s.retry_at = now, now + WATCHDOG_S
            return
        rid = self.client.next_rid()  # the owner's: its text must come back here
        shard = live_shard_for(rid, shards_alive(self.text_rings))
        try:
            if shard is None:
                raise NoCapacity(RETRY_FIRST_S, "no live detokenizer shard")
            # Prefill recomputes prompt + the tokens streamed: placed by their cache hits.
            lora = s.req.sampling.lora
            salt = None if lora is None else lora.salt
            hashes = self.router.hash_blocks(s.req.prompt_ids + s.token_ids, salt)
            fp = None if lora is None else lora.fingerprint
            placement = self.router.place(
                len(s.req.prompt_ids), s.req.sampling.max_tokens, hashes, lora=fp
            )
        except NoCapacity as e:
            if now - s.lost_since > RESUME_WINDOW_S:
                self.fail(s, f"request failed: no live worker to resume it on ({e.reason})")
            else:
                waited = now - s.lost_since
                s.retry_at = now + min(RETRY_MAX_S, max(RETRY_FIRST_S, waited))
            return
        streams = self.client.streams
        await self.client.abort_everywhere(s)
        self.router.release(s.placement)
        del streams[s.rid]
        old = s.rid
        s.rid, s.placement, s.shard = rid, placement, shard
        s.lost_since, s.retry_at = None, 0.0
        s.resumes += 1
        s.strikes.placed_tokens = len(s.token_ids)
        streams[s.rid] = s
        logger.warning(
            "rid %d: resumed as rid %d after %d tokens (prefill %d, decode %d, shard %d)",
            old,
            s.rid,
            len(s.token_ids),
            placement.prefill,
            placement.decode,
            shard,
        )
        try:
            await self.client.submit(s)
        except EngineUnavailable as e:
            # The worker died between placement and submission: lost again, retried.
            logger.warning("rid %d: resubmission failed (%s); retrying", s.rid, e)
            s.lost_since, s.retry_at = now, now + RETRY_FIRST_S

    def _dead_workers(self) -> DeadSet:
        dead: DeadSet = {}
        now_ns = time.monotonic_ns()
        live = {(r.role, r.index): r for r in self.table.snapshot()}
        for (role, index), row in live.items():
            if role is None:
                continue
            if row.state in (WorkerState.DEAD, WorkerState.FAILED):
                how = describe_exit(row.exit_status)
            elif row.state == WorkerState.READY and stalled(
                row.heartbeat_ns, now_ns, self.stall_timeout_s
            ):
                how = "stalled"
            else:
                continue
            dead[(role, index, row.generation)] = Death(role, index, row.pid, how)
        for p in {s.placement for s in self.client.streams.values()}:
            p_key, d_key = p.keys
            for (role, index), gen in ((p_key, p.prefill_generation), (d_key, p.decode_generation)):
                now = live.get((role, index))
                if now is not None and now.generation != gen and role is not None:
                    # restarted since placement; the dead process's pid is gone with it
                    dead.setdefault((role, index, gen), Death(role, index, 0, "restarted"))
        for k, ring in enumerate(self.text_rings):
            if not ring.peer_alive():
                dead[(None, k, 0)] = Death(None, k, ring.peer_pid, "died")
        return dead

    def fail(self, s: Stream, message: str, log: bool = True) -> None:
        """End ``s`` with ``finish = ERROR`` and ``message``; it is never resumed again."""
        if log:
            logger.error("rid %d: %s", s.rid, message)
        s.lost_since = None
        s.resumes = MAX_RESUMES
        s.queue.put_nowait(
            TextDelta(rid=s.rid, text="", token_ids=[], finish=int(Finish.ERROR), error=message)
        )
        self.client.streams.pop(s.rid, None)
