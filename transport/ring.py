"""Single-producer/single-consumer byte rings in shared memory.

Layout of a ring segment (all u64, little-endian; each cursor and flag on its own 128-byte
line so the two sides never write the same cache line; 128 covers aarch64 parts with
128-byte lines and x86's adjacent-line prefetcher):

    0      magic, capacity           written once by the creator
    128    tail      producer-owned  total bytes ever published
    256    head      consumer-owned  total bytes ever released
    384    sleeping  consumer sets 1 before it sleeps; the producer clears it and rings
    512    waiting   producer sets 1 before it sleeps on a full ring; the consumer clears it
    640    producer pid, 768 consumer pid   written on attach (see liveness.py)
    4096   data[capacity]                   capacity a power of two

A record is a u32 length, 4 pad bytes, then the payload padded to 8 bytes; it may wrap
around the end of the data area (copied in two pieces). Cursors grow monotonically and are
masked on use, so ``tail - head`` is the number of bytes in flight and never overflows.

Ordering argument (why this holds on aarch64 as on x86-64). Payload bytes are plain
stores/loads through the mmap; only the cursors use the ordered accesses of ``_atomics``:
  * producer: write payload, then ``store_release(tail)``; consumer: ``load_acquire(tail)``,
    then read payload. Release/acquire on the same word means every payload byte written
    before the release is visible to loads after the acquire.
  * consumer: copy the payload out, then ``store_release(head)``; producer:
    ``load_acquire(head)`` before overwriting. The release also orders the consumer's
    earlier *loads*, so the producer never overwrites bytes that are still being read.
    That is also why ``get`` copies out before releasing: no view of ring memory escapes.
  * sleep/wake needs a full fence on both sides (store-load order); see doorbell.py.

The per-record path (``ring_put``, ``ring_drain``) runs in the C helper ``_atomics.c``,
which follows exactly this protocol; Python keeps sizing, waiting and liveness.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from dataclasses import dataclass
from typing import Literal

from transport import _atomics
from transport.doorbell import Doorbell, block_on, drain_eventfd, new_eventfd
from transport.errors import PeerDead, RecordTooLarge, RingFull
from transport.liveness import PeerWatch
from transport.segment import Segment
from wire.json_spec import JsonSpec

RingEnd = Literal["producer", "consumer"]  # which side of a ring a process holds

_MAGIC = 0x70647365_72696E67  # "pdsering"
_OFF_MAGIC, _OFF_CAP = 0, 8
_OFF_TAIL, _OFF_HEAD, _OFF_SLEEPING, _OFF_WAITING = 128, 256, 384, 512
_OFF_PID = {"producer": 640, "consumer": 768}
_DATA = 4096
_LEN = struct.Struct("<Ixxxx")  # record header; the C fast path writes the same bytes
_SLICE_S = 0.5  # longest kernel sleep between liveness checks of a full ring


@dataclass(frozen=True, slots=True)
class RingSpec(JsonSpec):
    """Everything a child needs to attach: inherited fds (segment, doorbell, space) + size."""

    tag: str
    fd: int
    capacity: int
    doorbell_fd: int
    space_fd: int


def footprint(nbytes: int) -> int:
    """Ring bytes a record of ``nbytes`` occupies: header + payload padded to 8."""
    return _LEN.size + ((nbytes + 7) & ~7)


class Ring:
    """One side of an SPSC ring. Create in the launcher, attach in each peer."""

    def __init__(self, spec: RingSpec, role: RingEnd | None, doorbell_fd: int) -> None:
        self.spec = spec
        self.role = role
        self._seg = Segment.attach_fd(spec.fd, _DATA + spec.capacity, spec.tag)
        self._mm = self._seg.buf
        self._anchor = ctypes.c_char.from_buffer(self._mm)  # pins the mapping while we live
        base = ctypes.addressof(self._anchor)
        self._tail_addr, self._head_addr = base + _OFF_TAIL, base + _OFF_HEAD
        self._sleeping_addr, self._waiting_addr = base + _OFF_SLEEPING, base + _OFF_WAITING
        self._base, self._cap = base, spec.capacity
        self._doorbell_fd = doorbell_fd
        self._peer: PeerWatch | None = None
        if role is not None:
            _atomics.store_release(base + _OFF_PID[role], os.getpid())
            peer = "consumer" if role == "producer" else "producer"
            self._peer = PeerWatch(base + _OFF_PID[peer], f"ring {spec.tag} {peer}")

    @classmethod
    def create(cls, tag: str, capacity: int, doorbell: Doorbell | None = None) -> Ring:
        """Create a ring (launcher side). ``doorbell``: the consumer's, else a private one."""
        if capacity < 64 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two >= 64, got {capacity}")
        seg = Segment.create(f"ring.{tag}", _DATA + capacity)
        struct.pack_into("<QQ", seg.buf, _OFF_MAGIC, _MAGIC, capacity)
        seg.close()
        bell_fd = doorbell.fd if doorbell is not None else new_eventfd()
        spec = RingSpec(tag, seg.spec.fd, capacity, bell_fd, new_eventfd())
        return cls(spec, None, bell_fd)

    @classmethod
    def attach(cls, spec: RingSpec, role: RingEnd, doorbell: Doorbell | None = None) -> Ring:
        """Attach as ``role``; ``doorbell`` overrides the consumer doorbell in the spec."""
        return cls(spec, role, doorbell.fd if doorbell is not None else spec.doorbell_fd)

    # ---- producer -------------------------------------------------------------------

    def try_put(self, record: bytes) -> bool:
        """Publish ``record`` if it fits now; False if the ring is full. Never blocks.

        Raises RecordTooLarge, or PeerDead once the consumer is known to have exited.
        """
        self._check_size(record)
        return self._put_now(record)

    def put(self, record: bytes, timeout: float | None = None) -> None:
        """Publish ``record``, waiting for space up to ``timeout`` seconds (None: forever).

        Raises RecordTooLarge, RingFull on timeout, PeerDead if the consumer is known to
        have exited (checked on every wait for space, remembered after). Nothing is
        written when it raises.
        """
        self._check_size(record)
        if not self._put_now(record):
            self._wait_and_put(record, timeout)

    def _check_size(self, record: bytes) -> None:
        assert self._peer is not None and self.role == "producer", f"put on {self.role} side"
        if self._peer.known_dead():
            raise PeerDead(f"consumer of ring {self.spec.tag} (pid {self._peer.pid}) died")
        if footprint(len(record)) > self._cap:
            raise RecordTooLarge(
                f"record of {len(record)} bytes needs {footprint(len(record))} ring bytes; "
                f"ring {self.spec.tag} holds {self._cap}"
            )

    def _put_now(self, record: bytes) -> bool:
        status = _atomics.ring_put(self._base, self._cap, record)
        if status == 2:  # the consumer had announced sleep: wake it
            os.eventfd_write(self._doorbell_fd, 1)
        return status != 0

    def _wait_and_put(self, record: bytes, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        assert self._peer is not None
        while True:
            _atomics.store_release(self._waiting_addr, 1)
            _atomics.fence()  # announce before re-checking, as the consumer does (doorbell.py)
            if self._put_now(record):
                return
            if not self._peer.alive():
                raise PeerDead(f"consumer of ring {self.spec.tag} (pid {self._peer.pid}) died")
            remaining = _SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise RingFull(f"ring {self.spec.tag} full for {timeout}s")
            pidfd = self._peer.pidfd()
            fds = [self.spec.space_fd] if pidfd is None else [self.spec.space_fd, pidfd]
            block_on(fds, min(remaining, _SLICE_S))
            drain_eventfd(self.spec.space_fd)

    # ---- consumer -------------------------------------------------------------------

    def readable(self) -> bool:
        """True if a record is waiting (consumer side; no syscall)."""
        return _atomics.load_acquire(self._tail_addr) != _atomics.load_acquire(self._head_addr)

    def drain(self, max_records: int) -> list[bytes]:
        """Copy out and release up to ``max_records`` records (one release for all)."""
        records, producer_waiting = _atomics.ring_drain(self._base, self._cap, max_records)
        if producer_waiting:
            os.eventfd_write(self.spec.space_fd, 1)
        return records

    def reset(self) -> None:
        """Discard everything queued (a restarted consumer drops its predecessor's records)."""
        assert self.role == "consumer"
        _atomics.store_release(self._head_addr, _atomics.load_acquire(self._tail_addr))
        _atomics.fence()
        if _atomics.load_acquire(self._waiting_addr) and _atomics.exchange(self._waiting_addr, 0):
            os.eventfd_write(self.spec.space_fd, 1)

    # ---- both -----------------------------------------------------------------------

    def announce_sleep(self) -> None:
        _atomics.store_release(self._sleeping_addr, 1)

    def peer_alive(self) -> bool:
        """False once the other side has exited (known within one poll of its pidfd)."""
        assert self._peer is not None, "the creator's handle has no peer"
        return self._peer.alive()

    @property
    def peer_pid(self) -> int:
        """The attached peer's pid (0 before it attached)."""
        return 0 if self._peer is None else self._peer.pid

    def peer_pidfd(self) -> int | None:
        return None if self._peer is None else self._peer.pidfd()

    def on_peer_pidfd_ready(self) -> None:
        assert self._peer is not None
        self._peer.on_pidfd_ready()

    def used_bytes(self) -> int:
        return _atomics.load_acquire(self._tail_addr) - _atomics.load_acquire(self._head_addr)

    def close(self) -> None:
        """Unmap this side. fds stay open (the launcher re-hands them to restarted peers)."""
        if self._peer is not None:
            self._peer.close()
        del self._anchor
        self._mm = memoryview(b"")
        self._seg.close()
