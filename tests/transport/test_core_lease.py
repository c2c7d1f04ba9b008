"""The engine workers' core lease: never more cores held than the host has, a lone busy
worker gets them all, busy workers share, and a dead holder's cores come back."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import time

from transport.core_lease import CoreLease, lease_nbytes
from transport.load_table import LoadTable
from wire.roles import Role


def _region(slots: int) -> mmap.mmap:
    return mmap.mmap(-1, lease_nbytes(slots))  # anonymous shared: forked children see it


def test_a_lone_worker_gets_every_core_and_gives_them_back() -> None:
    buf = _region(2)
    a, b = CoreLease(buf, 2, 0, 4), CoreLease(buf, 2, 1, 4)
    assert a.acquire(4) == 4
    a.release()
    assert b.acquire(8) == 4  # asks for more than there are: gets them all
    assert b.held_total() == 4


def test_a_waiter_gets_a_core_at_the_next_release_and_busy_workers_share() -> None:
    buf = _region(2)
    a = CoreLease(buf, 2, 0, 2)
    assert a.acquire(2) == 2

    def waiter(q: mp.Queue) -> None:  # type: ignore[type-arg]
        b = CoreLease(buf, 2, 1, 2)
        q.put(b.acquire(2))
        time.sleep(0.2)
        b.release()

    q: mp.Queue = mp.get_context("fork").Queue()  # type: ignore[type-arg]
    p = mp.get_context("fork").Process(target=waiter, args=(q,))
    p.start()
    time.sleep(0.1)  # the waiter now waits, marked as waiting
    assert q.empty()
    a.release()
    assert q.get(timeout=5) == 2  # nobody else busy: it takes both
    # While it holds both, a new acquire waits; then, with the waiter marked, the split
    # leaves one core for it: busy workers end on one core each.
    assert a.acquire(2) >= 1
    assert a.held_total() <= 2
    a.release()
    p.join(5)


def _hammer(buf: mmap.mmap, slots: int, slot: int, cores: int, n: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    lease = CoreLease(buf, slots, slot, cores)
    worst = 0
    for i in range(n):
        assert 1 <= lease.acquire(cores) <= cores
        worst = max(worst, lease.held_total())
        if i % 7 == 0:
            time.sleep(0.0005)  # a step
        lease.release()
    out.put(worst)


def test_concurrent_workers_never_hold_more_cores_than_the_host_has() -> None:
    slots, cores = 4, 2
    buf = _region(slots)
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [
        ctx.Process(target=_hammer, args=(buf, slots, s, cores, 400, out)) for s in range(slots)
    ]
    for p in procs:
        p.start()
    worst = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert max(worst) <= cores
    assert CoreLease(buf, slots, 0, cores).held_total() == 0


def test_cores_of_a_killed_holder_are_taken_back() -> None:
    buf = _region(2)
    ctx = mp.get_context("fork")
    ready = ctx.Event()

    def hold_forever() -> None:
        CoreLease(buf, 2, 0, 2).acquire(2)
        ready.set()
        time.sleep(60)

    p = ctx.Process(target=hold_forever)
    p.start()
    assert ready.wait(10)
    os.kill(p.pid or 0, signal.SIGKILL)
    p.join(5)
    b = CoreLease(buf, 2, 1, 2)
    t0 = time.monotonic()
    assert b.acquire(2) == 2  # after noticing the holder is gone
    assert time.monotonic() - t0 < 5


def test_a_stopped_holder_does_not_stall_the_others() -> None:
    """A SIGSTOPped worker keeps its pid but will not give its cores back until it is
    continued: the others take its share rather than wait on it, and it releases
    normally once it runs again."""
    buf = _region(2)
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def hold_then_release() -> None:
        lease = CoreLease(buf, 2, 0, 2)
        lease.acquire(2)
        ready.set()
        done.wait(60)
        lease.release()

    p = ctx.Process(target=hold_then_release)
    p.start()
    assert ready.wait(10)
    os.kill(p.pid or 0, signal.SIGSTOP)
    try:
        b = CoreLease(buf, 2, 1, 2)
        assert b.acquire(2) == 2  # returns at all: the stopped holder's share came back
        b.release()
    finally:
        os.kill(p.pid or 0, signal.SIGCONT)
    done.set()
    p.join(10)
    assert p.exitcode == 0
    assert CoreLease(buf, 2, 1, 2).held_total() == 0


def test_a_lock_left_by_a_stopped_process_is_freed() -> None:
    ctx = mp.get_context("fork")
    sleeper = ctx.Process(target=time.sleep, args=(60,))
    sleeper.start()
    os.kill(sleeper.pid or 0, signal.SIGSTOP)
    try:
        buf = _region(2)
        lease = CoreLease(buf, 2, 0, 2)
        words = memoryview(buf).cast("q")
        words[0], words[1] = 1, sleeper.pid or 0  # as if stopped inside its critical section
        assert lease.acquire(1) == 1
    finally:
        os.kill(sleeper.pid or 0, signal.SIGKILL)
        sleeper.join(5)


def test_the_lease_lives_after_the_load_table_rows() -> None:
    n = 3
    buf = bytearray(LoadTable.layout_nbytes(n))
    table = LoadTable(buf, n)
    assert table.core_lease(2, 2).acquire(2) == 2
    table.writer(0).claim(Role.PREFILL, 0, pid=1234)
    rows = table.snapshot()
    assert (rows[0].role, rows[0].pid) == (Role.PREFILL, 1234)  # rows untouched by the lease
    assert table.core_lease(1, 2).held_total() == 2  # and the lease by the rows
