"""Cores for whoever has work: a lease of the host's CPU cores among engine workers.

On a small host the prefill and decode workers are rarely busy at once: a static split
(``cores // workers`` threads each) leaves a decode worker on one core while the prefill
worker idles, and giving every worker all cores makes their OpenMP pools fight whenever
both run. Here each worker, before a step, leases cores from one shared count and sets
its thread count to what it got; after the step it gives them back. An idle worker holds
none, so a lone busy worker gets every core.

Invariant: the cores held by all workers together never exceed ``cores``. A worker
takes at least one core or waits (sleeping, with back-off; it only waits while it has
work, so nothing spins while idle). Fairness: a worker that had to wait marks itself
waiting, and others then leave one core per waiter free; a waiter may take any core
that is free. So with two busy workers on two cores each gets one.

Layout (a region after the load table's rows, shared by every engine worker):
``lock`` u64 (0 free, 1 held), ``owner`` u64 (the lock holder's pid), then per slot
``held``, ``waiting``, ``pid`` (i64 each, 32 bytes a slot). The lock is a test-and-set
word over ``transport._atomics.exchange``; its critical sections are a few microseconds.
A worker killed or stopped (SIGSTOP) while holding the lock or cores is noticed by a
waiter (its pid is gone, or /proc says it is stopped) and its share is taken back: a
stalled worker must not stall every other worker through the lease. One that resumes
runs its step on the threads it had (the host is briefly oversubscribed) and then
releases as usual.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from transport import _atomics
from transport.segment import pid_running

HEADER_NBYTES = 16
SLOT_WORDS = 4  # held, waiting, pid, (pad)
_HELD, _WAITING, _PID = 0, 1, 2
_STALE_LOCK_S = 0.05  # a critical section lasts microseconds; past this, check the holder
_REAP_AFTER_S = 0.1  # waiting this long for a core: look for holders that died


def lease_nbytes(num_slots: int) -> int:
    return HEADER_NBYTES + num_slots * SLOT_WORDS * 8


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, which children inherit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class CoreLease:
    """One worker's handle on the shared lease: ``acquire`` before a step, ``release``
    after (or ``with lease.hold(): ...``). ``buf`` is the region, ``lease_nbytes`` long."""

    def __init__(self, buf: Any, num_slots: int, slot: int, cores: int) -> None:
        if not 0 <= slot < num_slots:
            raise IndexError(f"slot {slot} outside 0..{num_slots - 1}")
        if cores < 1:
            raise ValueError(f"a core lease needs at least one core, got {cores}")
        self.cores, self.slot = cores, slot
        words = np.frombuffer(buf, np.int64, 2 + num_slots * SLOT_WORDS)
        self._lock_addr = words.__array_interface__["data"][0]
        assert self._lock_addr % 8 == 0, "the lock word must be 8-byte aligned"
        self._owner = words[1:2]
        self._slots = words[2:].reshape(num_slots, SLOT_WORDS)
        self._pid = os.getpid()
        with self._locked():  # a restarted worker drops what its predecessor held
            self._slots[slot] = (0, 0, self._pid, 0)
        self.granted = 0

    @contextmanager
    def _locked(self) -> Iterator[None]:
        since = time.monotonic()
        tries = 0
        while _atomics.exchange(self._lock_addr, 1) != 0:
            tries += 1
            if tries < 64:
                os.sched_yield()
                continue
            time.sleep(0.00005)
            if time.monotonic() - since > _STALE_LOCK_S and not pid_running(int(self._owner[0])):
                # The holder died (or was stopped) inside its critical section: the
                # slots it was writing are whole words, so the table is still
                # consistent; free the lock. A stopped holder that resumes finishes
                # its section and rewrites only its own slot, so the counts heal.
                _atomics.store_release(self._lock_addr, 0)
                since = time.monotonic()
        self._owner[0] = self._pid
        try:
            yield
        finally:
            self._owner[0] = 0
            _atomics.store_release(self._lock_addr, 0)

    def acquire(self, want: int) -> int:
        """Take between 1 and ``want`` cores, waiting while none is free; returns how many."""
        want = max(1, min(want, self.cores))
        waited_since: float | None = None
        pause = 0.0002
        while True:
            with self._locked():
                s = self._slots
                others_held = int(s[:, _HELD].sum() - s[self.slot, _HELD])
                others_waiting = int(s[:, _WAITING].sum() - s[self.slot, _WAITING])
                free = self.cores - others_held
                room = free - others_waiting
                if s[self.slot, _WAITING] and free >= 1:
                    room = max(room, 1)  # a waiter may take any free core
                grant = min(want, room)
                if grant >= 1:
                    s[self.slot, _HELD], s[self.slot, _WAITING] = grant, 0
                    self.granted = grant
                    return grant
                s[self.slot, _WAITING] = 1
            now = time.monotonic()
            waited_since = now if waited_since is None else waited_since
            if now - waited_since > _REAP_AFTER_S:
                self._reap_dead()
                waited_since = now
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def release(self) -> None:
        with self._locked():
            self._slots[self.slot, _HELD] = 0
            self._slots[self.slot, _WAITING] = 0
        self.granted = 0

    @contextmanager
    def hold(self, want: int) -> Iterator[int]:
        granted = self.acquire(want)
        try:
            yield granted
        finally:
            self.release()

    def held_total(self) -> int:
        """Cores held by all workers now (a snapshot; for tests and metrics)."""
        return int(self._slots[:, _HELD].sum())

    def _reap_dead(self) -> None:
        with self._locked():
            for row in self._slots:
                if (row[_HELD] or row[_WAITING]) and not pid_running(int(row[_PID])):
                    row[_HELD], row[_WAITING] = 0, 0
