"""POST /reset_prefix_cache: every tier forgets every prefix, then the answer.

Who does what, in order:
    frontend   sends ``ResetPrefixCache(epoch)`` to every engine worker (on the rings it
               already sends them requests and aborts on), ``epoch`` a fresh number.
    worker     between two steps, unhashes its whole pool (``BlockAllocator.forget_hashes``:
               cached blocks become free, blocks in use stay with their requests but no
               lookup finds them) and reports ``epoch`` in its load-table row.
    frontend   waits until every live engine worker of its node reports it (a worker that
               restarted meanwhile has an empty pool anyway), then clears tier 2
               (``HostStore.clear``: writes in flight are dropped at commit) and, with a
               tier 3, waits until its writer has deleted the namespace's files and
               reported tier 2's new epoch (``Persister.persist_some``).
A request that arrives while this runs may still reuse what a tier held a moment before;
one sent after the answer is a miss everywhere. Remote nodes' workers get the record too,
but only this node's are waited for (their tiers are their node's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from engine.kv.tiers.host_store import HostStore
from frontend.engine_link.engine_client import EngineUnavailable
from transport.load_table import LoadTable, WorkerState
from transport.ring import Ring
from transport.segment import pid_alive
from wire.records import Control, ResetPrefixCache
from wire.roles import Role

POLL_S = 0.01
DEFAULT_TIMEOUT_S = 30.0  # a worker in a long prefill step answers after that step


class ResetTimeout(Exception):
    """Some worker (or tier 3's writer) did not confirm the reset in time."""


@dataclass(frozen=True)
class ResetDone:
    workers: int  # engine workers that forgot their pools' prefixes
    host_blocks: int  # tier-2 blocks dropped
    disk_cleared: bool  # tier 3 emptied (False: there is none)


async def reset_prefix_cache(
    rings: Iterable[Ring],
    put: Callable[[Ring, Control], Awaitable[None]],
    table: LoadTable,
    node: str,
    host: HostStore | None,
    has_disk: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ResetDone:
    """Run the reset above over ``rings`` (one per engine worker) with ``put``; raises
    ``ResetTimeout`` naming what did not confirm within ``timeout_s``."""
    epoch = time.time_ns()
    # Which workers must confirm: the live engine workers of this node, as they are now.
    waiting = {
        r.slot: r.generation
        for r in table.snapshot()
        if r.role in (Role.PREFILL, Role.DECODE, Role.COLOCATED)
        and r.node == node
        and r.state is WorkerState.READY
        and pid_alive(r.pid)
    }
    msg = ResetPrefixCache(epoch)
    for ring in rings:
        with contextlib.suppress(EngineUnavailable):  # a dead worker restarts empty
            await put(ring, msg)
    deadline = time.monotonic() + timeout_s
    confirmed = 0
    while waiting:
        for r in table.snapshot():
            gen = waiting.get(r.slot)
            if gen is None:
                continue
            if r.prefix_reset_epoch >= epoch:
                confirmed += 1
            elif r.generation == gen and pid_alive(r.pid) and r.state is WorkerState.READY:
                continue  # not yet
            del waiting[r.slot]  # done, or restarted (a fresh pool) or gone
        if waiting and time.monotonic() > deadline:
            raise ResetTimeout(f"load-table slots {sorted(waiting)} did not confirm the reset")
        if waiting:
            await asyncio.sleep(POLL_S)
    dropped = 0
    if host is not None:
        dropped = host.clear()
        if has_disk:
            target = host.epoch
            while host.disk_epoch < target:
                if time.monotonic() > deadline:
                    raise ResetTimeout("tier 3's writer did not delete its files")
                await asyncio.sleep(POLL_S)
    return ResetDone(confirmed, dropped, host is not None and has_disk)
