"""Poison requests: a death is blamed on the requests just given to the dead worker; one
blamed more often than its retries allow ends with an error, and explains its deaths;
last-chance requests re-enter one at a time, so innocents never die with the poison."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from frontend.engine_link.engine_client import EngineRequest
from frontend.engine_link.poison import (
    Death,
    Strikes,
    explained_pids,
    last_chance,
    poison_message,
    record_death,
)
from frontend.engine_link.recovery import Recovery, Stream
from router.router import Router
from transport.load_table import LoadTable, WorkerState
from wire.params import DetokParams, SamplingParams
from wire.records import Finish
from wire.roles import Role

ABORTED = Death(Role.DECODE, 0, 101, "killed by SIGABRT")


def test_a_death_is_blamed_only_on_requests_fresh_on_their_workers() -> None:
    steady, fresh = Strikes(placed_tokens=0), Strikes(placed_tokens=10)
    assert not record_death(steady, ABORTED, tokens=30, max_retries=1)
    assert steady.blamed == [] and steady.present == [ABORTED]
    assert not record_death(fresh, ABORTED, tokens=11, max_retries=1)  # prefill's token only
    assert fresh.blamed == [ABORTED] and last_chance(fresh, 1)
    assert not last_chance(steady, 1)


def test_the_death_after_the_last_retry_makes_a_request_poison_and_explains_its_deaths() -> None:
    s = Strikes()
    again = Death(Role.DECODE, 1, 102, "killed by SIGABRT")
    assert not record_death(s, ABORTED, 0, max_retries=1)
    assert record_death(s, again, 1, max_retries=1)
    message = poison_message(s)
    assert message.startswith("request ended: the decode worker died twice while serving it")
    assert "decode worker 1" in message
    assert explained_pids(s) == [101, 102]
    assert record_death(Strikes(), ABORTED, 0, max_retries=0)  # no retries: the first ends it


@dataclass
class _Ring:
    """A text ring whose shard is alive (all recovery asks of it)."""

    peer_pid: int = field(default_factory=os.getpid)

    def peer_alive(self) -> bool:
        return True


class _Client:
    """The engine client as recovery sees it: streams, rids, (re)submission, poison."""

    def __init__(self) -> None:
        self.streams: dict[int, Stream] = {}
        self.rids = iter(range(1000, 2000))
        self.submitted: list[Stream] = []
        self.explained: list[int] = []

    def next_rid(self) -> int:
        return next(self.rids)

    async def submit(self, s: Stream) -> None:
        self.submitted.append(s)

    async def abort_everywhere(self, s: Stream) -> None:
        pass

    def poisoned(self, pids: list[int]) -> None:
        self.explained += pids


def _table() -> LoadTable:
    """prefill 0 and decode 0 (this process's pid), decode 1 (its parent's): all READY."""
    table = LoadTable(bytearray(LoadTable.layout_nbytes(3)), 3)
    rows = ((Role.PREFILL, 0, os.getpid()), (Role.DECODE, 0, os.getpid()))
    for slot, (role, index, pid) in enumerate((*rows, (Role.DECODE, 1, os.getppid()))):
        w = table.writer(slot)
        w.claim(role, index, pid=pid, block_size=16)
        w.publish(total_kv_blocks=100, free_kv_blocks=100)
        w.set_state(WorkerState.READY)
    return table


def _died(table: LoadTable, slot: int) -> None:
    row = table.snapshot()[slot]
    assert row.role is not None
    table.writer(slot).mark_exited(WorkerState.DEAD, -6, row.role, row.index)


def _restarted(table: LoadTable, slot: int, pid: int) -> None:
    row = table.snapshot()[slot]
    assert row.role is not None
    w = table.writer(slot)
    w.claim(row.role, row.index, pid=pid, block_size=16)
    w.set_state(WorkerState.READY)


def test_a_poison_request_ends_after_its_retry_and_the_requests_beside_it_go_on() -> None:
    table = _table()
    router = Router(table, "least-load")
    client = _Client()
    recovery = Recovery(client, router, table, [_Ring()], max_retries=1)  # type: ignore[arg-type]
    sampling = SamplingParams(max_tokens=32, temperature=0.0)
    streams = []
    for rid in range(9):  # all on decode 0 (decode 1 is not READY yet), one token each
        req = EngineRequest(rid, [5, 6, 7], sampling, DetokParams())
        placement = router.place(3, 32, prefill=0)
        s = Stream(req, asyncio.Queue(), rid, placement, 0, token_ids=[1])
        client.streams[rid] = s
        streams.append(s)
    assert {s.placement.decode for s in streams} <= {0, 1}
    for s in streams:  # the same decode worker under all of them
        s.placement = streams[0].placement
    poison = streams[0]
    asyncio.run(_kill_and_recover(table, recovery, client, streams, poison))


async def _kill_and_recover(
    table: LoadTable, recovery: Recovery, client: _Client, streams: list[Stream], poison: Stream
) -> None:
    dead_slot = 1 if streams[0].placement.decode == 0 else 2
    _died(table, dead_slot)
    await recovery.recover()
    # Every one of them was fresh: blamed once, on its last chance; one re-enters at a time.
    assert all(len(s.strikes.blamed) == 1 for s in streams)
    assert client.submitted == [poison]
    await recovery.recover()
    assert client.submitted == [poison]  # the others wait while it is fresh
    # The poison kills its new decode worker as it enters: it ends, with the deaths it
    # explains; nobody else was on that worker.
    _died(table, 1 if poison.placement.decode == 0 else 2)
    _restarted(table, dead_slot, os.getpid())
    await recovery.recover()
    end = poison.queue.get_nowait()
    assert end.finish == Finish.ERROR and "died twice" in (end.error or "")
    assert client.explained and poison.rid not in client.streams
    # The others re-enter one by one, each once its tokens show it past its entry.
    seen = 0
    for _ in range(40):
        await recovery.recover()
        for s in client.submitted[seen:]:
            s.token_ids += [2, 3]  # its new workers stream
        seen = len(client.submitted)
        for s in streams[1:]:
            s.retry_at = 0.0
    innocents = streams[1:]
    assert sorted(map(id, client.submitted[1:])) == sorted(map(id, innocents))
    assert all(s.resumes == 1 and s.queue.empty() for s in innocents)
