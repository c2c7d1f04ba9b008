"""One wakeup eventfd per consumer process, shared by all of its inbound rings.

Sleep/wake handshake (a Dekker pair; both sides need a full fence, acquire/release alone
would let each side read the other's stale value and the consumer sleep forever):

    consumer: flag := 1 ; fence ; if any ring has data: don't sleep ; else poll(eventfd)
    producer: tail := t ; fence ; if exchange(flag, 0) == 1: write(eventfd)

Either the consumer's re-check sees the new tail, or the producer sees the flag and rings.
A producer rings at most once per sleep because it clears the flag it saw. Stale counts
left in the eventfd only cause a spurious wakeup, never a lost one.

For asyncio: ``loop.add_reader(doorbell.fileno(), cb)``; in ``cb`` call ``clear()``, drain
the rings, and ``arm(rings)`` before returning; if ``arm`` reports data, drain again.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from transport import _atomics
from wire.json_spec import JsonSpec

# Poll slice while blocked: bounds how late a restarted peer's new pid is noticed.
_SLICE_S = 0.5
SPIN_S = 50e-6


@dataclass(frozen=True, slots=True)
class DoorbellSpec(JsonSpec):
    fd: int


def new_eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def drain_eventfd(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(fd)


def block_on(fds: Sequence[int], timeout: float) -> list[int]:
    """Sleep until one of ``fds`` is readable or ``timeout`` passes; the readable fds."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(max(0.0, timeout) * 1000.0)]


class Watched(Protocol):
    """What a doorbell needs of an inbound ring (``transport.ring.Ring`` is one)."""

    def announce_sleep(self) -> None: ...
    def readable(self) -> bool: ...
    def peer_pidfd(self) -> int | None: ...
    def on_peer_pidfd_ready(self) -> None: ...


class Doorbell:
    """The eventfd a consumer sleeps on; producers of its rings ring it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._spin = True  # the last wait ended within SPIN_S (``wait``)

    @classmethod
    def create(cls) -> Doorbell:
        return cls(new_eventfd())

    @property
    def spec(self) -> DoorbellSpec:
        return DoorbellSpec(self.fd)

    @classmethod
    def attach(cls, spec: DoorbellSpec) -> Doorbell:
        return cls(spec.fd)

    def fileno(self) -> int:
        return self.fd

    def clear(self) -> None:
        """Consume pending rings of the bell (never blocks)."""
        drain_eventfd(self.fd)

    def arm(self, rings: Sequence[Watched]) -> bool:
        """Announce sleep to every producer; True if a ring already has data (don't sleep)."""
        for ring in rings:
            ring.announce_sleep()
        _atomics.fence()
        return any(ring.readable() for ring in rings)

    def wait(self, rings: Sequence[Watched], timeout: float) -> None:
        """Return when a ring has data, a ring's producer died, or ``timeout`` passed.

        Spins for at most ``SPIN_S`` first, where the last wait ended within that (records
        arriving close together); then sleeps in the kernel (no CPU while idle). Records
        further apart than that (one stream's tokens, ~4 ms) would only meet a spin that
        fails, on a core the engine's step may need. A dead producer wakes the waiter
        once; the caller checks ``ring.peer_alive()``.
        """
        start = time.monotonic()
        try:
            self._wait(rings, start, timeout)
        finally:
            self._spin = time.monotonic() - start < SPIN_S

    def _wait(self, rings: Sequence[Watched], start: float, timeout: float) -> None:
        deadline = start + timeout
        spin_end = start + min(SPIN_S, timeout) if self._spin else start
        while time.monotonic() < spin_end:
            if any(ring.readable() for ring in rings):
                return
        while not self.arm(rings):
            watched = {}
            for ring in rings:
                pidfd = ring.peer_pidfd()
                if pidfd is not None:
                    watched[pidfd] = ring
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready = block_on([self.fd, *watched], min(remaining, _SLICE_S))
            self.clear()
            dead = [watched[fd] for fd in ready if fd in watched]
            for ring in dead:
                ring.on_peer_pidfd_ready()
            if dead:
                return
