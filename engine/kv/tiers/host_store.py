"""Tier 2: a block store in shared memory, one per host, used by every worker on it.

Layout of the mapped buffer (all little-endian u64 unless named):
    header   (64,)                        magic, format, geometry, clock, epoch, ns, counters
    index    (table,) i32                 open-addressed hash of key -> slot + 1 (0 empty,
                                          -1 deleted); table = a power of two >= 2 slots
    meta     (slots, 8)                   version, tick, pid, key lo/hi, parent lo/hi, flags
    tokens   (slots, block_size) u32      the block's token ids (checked on every lookup)
    payload  (slots, stride) u8           the block's bytes, as one pool block holds them

A slot is FREE (key 0, version even), BEING WRITTEN (version odd: its key names the
block being written, so a second writer of the same block backs off) or VALID (key set,
version even). Every change of meta happens under one lock: a POSIX record lock on the
segment's fd (the kernel drops it when its holder dies, so a killed worker never wedges
the host) plus a process-wide mutex (record locks do not exclude threads). Payloads are
copied *outside* the lock; a reader notes a slot's version under the lock, copies, and
re-checks the version under the lock: if a writer reused the slot meanwhile the version
moved and the read is a miss, never wrong bytes (a seqlock whose checks are fenced by the
lock's syscalls, so it holds on aarch64 as well as x86-64).

The index changes by single aligned 32-bit stores, so a holder killed mid-change leaves
it consistent; it is rebuilt from meta when deleted entries fill a quarter of it.

A writer killed mid-copy leaves its slot odd; a writer needing room reclaims odd slots
whose pid is dead. ``clear`` frees every valid slot and bumps the epoch, so a write that
began before it is dropped at commit (the base of a future ``/reset_prefix_cache``).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

_MAGIC = 0x5044_4B56_5449_4552  # "PDKVTIER"
_FORMAT = 1
_HEADER_WORDS = 64
_ALIGN = 4096
# header words
H_MAGIC, H_FORMAT, H_SLOTS, H_BLOCK, H_PAYLOAD, H_STRIDE, H_TICK, H_EPOCH, H_DELETED = range(9)
# The last ``clear`` epoch tier 3's writer has applied to the disk (it empties its
# namespace's files when the epoch moves: ``Persister.persist_some``).
H_DISK_EPOCH = 9
H_NAMESPACE = 10  # and 11: the blocks' namespace digest, 0 until a worker adopts one
# counters (header words from 16): what /metrics shows, summed over the host's workers
COUNTERS = (
    "host_stores",
    "host_hit_blocks",
    "host_miss_blocks",
    "host_evictions",
    "host_bytes_in",
    "host_bytes_out",
    "host_load_ns",
    "host_store_ns",
    "disk_hit_blocks",
    "disk_miss_blocks",
    "disk_bytes_read",
    "disk_bytes_written",
    "disk_load_ns",
    "disk_store_ns",
    "disk_evictions",
    "disk_quarantined",
    "disk_usage_bytes",
    "disk_dropped",
    "disk_files",
)
_C0 = 16
# meta columns
M_VERSION, M_TICK, M_PID, M_KEY_LO, M_KEY_HI, M_PAR_LO, M_PAR_HI, M_FLAGS = range(8)
F_PERSISTED = 1  # tier 3 has this block (the persister wrote or found its file)

_PROCESS_LOCK = threading.Lock()  # record locks are per process: this excludes threads


@dataclass(frozen=True)
class Geometry:
    slots: int
    block_size: int
    payload_nbytes: int

    @property
    def stride(self) -> int:
        return -(-self.payload_nbytes // 64) * 64

    @property
    def table(self) -> int:
        return 1 << (2 * self.slots - 1).bit_length()

    @property
    def offsets(self) -> tuple[int, int, int, int]:
        """Byte offsets of meta, tokens, payloads, and the total size (the index sits
        between the header and meta)."""
        meta = _HEADER_WORDS * 8 + -(-self.table * 4 // 64) * 64
        tokens = meta + self.slots * 64
        payload = -(-(tokens + self.slots * self.block_size * 4) // _ALIGN) * _ALIGN
        return meta, tokens, payload, payload + self.slots * self.stride

    @classmethod
    def for_budget(cls, nbytes: int, block_size: int, payload_nbytes: int) -> Geometry:
        """As many slots as ``nbytes`` holds (at least one)."""
        per_slot = -(-payload_nbytes // 64) * 64 + 64 + 4 * block_size + 16  # + index
        return cls(max(1, (nbytes - 2 * _ALIGN) // per_slot), block_size, payload_nbytes)


def key_words(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


def words_key(lo: int, hi: int) -> bytes:
    return int(lo).to_bytes(8, "little") + int(hi).to_bytes(8, "little")


@dataclass(frozen=True)
class Claim:
    """A slot ``begin_put`` reserved for one block, until ``end_put``."""

    slot: int
    epoch: int  # tier 2's clear epoch when claimed: a clear since drops the block
    started_ns: int


@dataclass(frozen=True)
class Found:
    """A valid slot a lookup matched, and the version its copy must still see."""

    slot: int
    version: int


class HostStore:
    """A view of a tier-2 segment: ``fd`` is the shared-memory file, ``buf`` its mapping."""

    def __init__(self, fd: int, buf: memoryview) -> None:
        self.fd = fd
        self.header = np.frombuffer(buf, dtype="<u8", count=_HEADER_WORDS)
        if int(self.header[H_MAGIC]) != _MAGIC or int(self.header[H_FORMAT]) != _FORMAT:
            raise ValueError("not a pdserve tier-2 segment (or another format version)")
        g = Geometry(*(int(self.header[i]) for i in (H_SLOTS, H_BLOCK, H_PAYLOAD)))
        self.geometry = g
        meta, tokens, payload, end = g.offsets
        if len(buf) < end:
            raise ValueError(f"tier-2 segment of {len(buf)} bytes, its header says {end}")
        self.index = np.frombuffer(buf, dtype="<i4", count=g.table, offset=_HEADER_WORDS * 8)
        self.meta = np.frombuffer(buf, dtype="<u8", count=g.slots * 8, offset=meta).reshape(
            g.slots, 8
        )
        self.tokens = np.frombuffer(
            buf, dtype="<u4", count=g.slots * g.block_size, offset=tokens
        ).reshape(g.slots, g.block_size)
        self.payload = np.frombuffer(
            buf, dtype=np.uint8, count=g.slots * g.stride, offset=payload
        ).reshape(g.slots, g.stride)
        self._pid = os.getpid()

    @staticmethod
    def format(buf: memoryview, geometry: Geometry) -> None:
        """Write an empty store's header into a fresh (zeroed) segment."""
        header = np.frombuffer(buf, dtype="<u8", count=_HEADER_WORDS)
        header[H_SLOTS], header[H_BLOCK] = geometry.slots, geometry.block_size
        header[H_PAYLOAD], header[H_STRIDE] = geometry.payload_nbytes, geometry.stride
        header[H_FORMAT] = _FORMAT
        header[H_MAGIC] = _MAGIC

    # ---- locking and counters ------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        with _PROCESS_LOCK:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def count(self, name: str, n: int) -> None:
        """Add ``n`` to a counter; call with the lock held."""
        self.header[_C0 + COUNTERS.index(name)] += np.uint64(n)

    def counters(self) -> dict[str, int]:
        with self.locked():
            return {n: int(self.header[_C0 + i]) for i, n in enumerate(COUNTERS)}

    def set_counter(self, name: str, value: int) -> None:
        with self.locked():
            self.header[_C0 + COUNTERS.index(name)] = max(0, value)

    def _tick(self) -> int:
        self.header[H_TICK] += np.uint64(1)
        return int(self.header[H_TICK])

    # ---- lookups -------------------------------------------------------------------

    def _probe(self, key: bytes) -> tuple[int, int]:
        """(index position of ``key`` or -1, its slot or -1); lock held."""
        lo, hi = key_words(key)
        mask = len(self.index) - 1
        pos = lo & mask
        for _ in range(len(self.index)):
            entry = int(self.index[pos])
            if entry == 0:
                break
            if entry > 0:
                s = entry - 1
                if int(self.meta[s, M_KEY_LO]) == lo and int(self.meta[s, M_KEY_HI]) == hi:
                    return pos, s
            pos = (pos + 1) & mask
        return -1, -1

    def _find(self, key: bytes) -> int:
        """The slot whose key is ``key`` (valid or being written), or -1; lock held."""
        return self._probe(key)[1]

    def _index_add(self, key: bytes, slot: int) -> None:
        mask = len(self.index) - 1
        pos = key_words(key)[0] & mask
        while int(self.index[pos]) > 0:  # a free or deleted entry exists: table >= 2 slots
            pos = (pos + 1) & mask
        self.index[pos] = slot + 1

    def _index_drop(self, slot: int) -> None:
        """Forget ``slot``'s key in the index (before its key changes); lock held."""
        lo, hi = int(self.meta[slot, M_KEY_LO]), int(self.meta[slot, M_KEY_HI])
        if lo == hi == 0:
            return
        pos, s = self._probe(words_key(lo, hi))
        if pos >= 0 and s == slot:
            self.index[pos] = -1
            self.header[H_DELETED] += np.uint64(1)
            if int(self.header[H_DELETED]) * 4 > len(self.index):
                self._rebuild_index()

    def _rebuild_index(self) -> None:
        self.index[:] = 0
        self.header[H_DELETED] = 0
        for s in np.flatnonzero((self.meta[:, M_KEY_LO] | self.meta[:, M_KEY_HI]) != 0):
            self._index_add(words_key(self.meta[s, M_KEY_LO], self.meta[s, M_KEY_HI]), int(s))

    def lookup(self, keys: list[bytes], tokens: np.ndarray) -> list[Found]:
        """The valid slots of the longest leading run of ``keys`` whose token ids match
        ``tokens`` ``(len(keys), block_size)``; they become most recently used."""
        found: list[Found] = []
        with self.locked():
            for i, key in enumerate(keys):
                s = self._find(key)
                if s < 0 or int(self.meta[s, M_VERSION]) & 1:
                    break
                if not np.array_equal(self.tokens[s], tokens[i]):
                    break  # a different prefix under this key: never a hit
                self.meta[s, M_TICK] = self._tick()
                found.append(Found(s, int(self.meta[s, M_VERSION])))
        return found

    def still_valid(self, found: list[Found]) -> int:
        """How many leading ``found`` slots kept their version while the caller copied."""
        with self.locked():
            for n, f in enumerate(found):
                if int(self.meta[f.slot, M_VERSION]) != f.version:
                    return n
            return len(found)

    def count_lookup(self, hit_blocks: int, miss_blocks: int, nbytes: int, ns: int) -> None:
        with self.locked():
            self.count("host_hit_blocks", hit_blocks)
            self.count("host_miss_blocks", miss_blocks)
            self.count("host_bytes_out", nbytes)
            self.count("host_load_ns", ns)

    def held_run(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are valid blocks here (the router's guess: no token
        check, no copy, LRU order unchanged)."""
        with self.locked():
            for n, key in enumerate(keys):
                s = self._find(key)
                if s < 0 or int(self.meta[s, M_VERSION]) & 1:
                    return n
            return len(keys)

    def contains(self, key: bytes) -> bool:
        with self.locked():
            s = self._find(key)
            return s >= 0 and not int(self.meta[s, M_VERSION]) & 1

    # ---- stores --------------------------------------------------------------------

    def put(self, key: bytes, parent: bytes, tokens: np.ndarray, payload: np.ndarray) -> bool:
        """Store one block (``payload``: its bytes, u8); False if it is held or being
        written already. Evicts the least recently used block when no slot is free."""
        claim = self.begin_put(key)
        if claim is None:
            return False
        self.payload[claim.slot, : payload.nbytes] = payload
        self.end_put(claim, parent, tokens, payload.nbytes)
        return True

    def begin_put(self, key: bytes) -> Claim | None:
        """Claim a slot for ``key`` (BEING WRITTEN: lookups miss it, a second writer of
        the same key backs off); None if ``key`` is held or being written already, or no
        slot can be claimed. The caller fills ``payload[slot]`` and then calls
        ``end_put`` (an asynchronous copy may fill it meanwhile, e.g. a device's DMA)."""
        t0 = time.perf_counter_ns()
        with self.locked():
            if self._find(key) >= 0:
                return None
            slot = self._claim()
            if slot < 0:
                return None  # every slot is being written: drop, never wait
            m = self.meta[slot]
            m[M_VERSION] += np.uint64(1)  # odd: being written
            self._index_drop(slot)
            m[M_KEY_LO], m[M_KEY_HI] = key_words(key)
            self._index_add(key, slot)
            m[M_PID], m[M_FLAGS] = self._pid, 0
            return Claim(slot, int(self.header[H_EPOCH]), t0)

    def end_put(
        self, claim: Claim, parent: bytes, tokens: np.ndarray, nbytes: int, ok: bool = True
    ) -> None:
        """Publish ``claim``'s slot (its payload is written), or free it when not ``ok``
        (the copy failed) or when a ``clear`` came in between."""
        with self.locked():
            m = self.meta[claim.slot]
            if not ok or int(self.header[H_EPOCH]) != claim.epoch:
                self._index_drop(claim.slot)
                m[M_KEY_LO] = m[M_KEY_HI] = 0
            else:
                m[M_PAR_LO], m[M_PAR_HI] = key_words(parent)
                self.tokens[claim.slot] = tokens
                m[M_TICK] = self._tick()
                self.count("host_stores", 1)
                self.count("host_bytes_in", nbytes)
                self.count("host_store_ns", time.perf_counter_ns() - claim.started_ns)
            m[M_VERSION] += np.uint64(1)  # even: valid (or free, if dropped)

    def _claim(self) -> int:
        """A slot to overwrite: a free one, else the LRU valid one, else an orphaned
        write's (its writer died); -1 if none. Lock held; counts an eviction."""
        version, keys = self.meta[:, M_VERSION], self.meta[:, M_KEY_LO] | self.meta[:, M_KEY_HI]
        even = (version & np.uint64(1)) == 0
        free = np.flatnonzero(even & (keys == 0))
        if len(free):
            return int(free[0])
        valid = np.flatnonzero(even)
        if len(valid):
            slot = int(valid[np.argmin(self.meta[valid, M_TICK])])
            self.count("host_evictions", 1)
            return slot
        for slot in range(self.geometry.slots):
            if not _pid_alive(int(self.meta[slot, M_PID])):
                self.meta[slot, M_VERSION] += np.uint64(1)  # back to even, then claimed
                return slot
        return -1

    def clear(self) -> int:
        """Forget every block (writes in flight are dropped at commit); blocks dropped."""
        with self.locked():
            even = (self.meta[:, M_VERSION] & np.uint64(1)) == 0
            valid = even & ((self.meta[:, M_KEY_LO] | self.meta[:, M_KEY_HI]) != 0)
            self.meta[valid, M_KEY_LO] = 0
            self.meta[valid, M_KEY_HI] = 0
            self.meta[valid, M_VERSION] += np.uint64(2)  # readers mid-copy see a change
            self.header[H_EPOCH] += np.uint64(1)
            self._rebuild_index()  # writes in flight keep their entries
            return int(valid.sum())

    @property
    def epoch(self) -> int:
        """Bumped by every ``clear``."""
        with self.locked():
            return int(self.header[H_EPOCH])

    @property
    def disk_epoch(self) -> int:
        """The latest ``clear`` tier 3 has applied too."""
        with self.locked():
            return int(self.header[H_DISK_EPOCH])

    def set_disk_epoch(self, epoch: int) -> None:
        with self.locked():
            self.header[H_DISK_EPOCH] = epoch

    def adopt_namespace(self, namespace: bytes) -> bytes:
        """The store's namespace: ``namespace``, unless a worker adopted one before."""
        with self.locked():
            if not self.header[H_NAMESPACE : H_NAMESPACE + 2].any():
                self.header[H_NAMESPACE : H_NAMESPACE + 2] = key_words(namespace)
            return words_key(*self.header[H_NAMESPACE : H_NAMESPACE + 2].tolist())

    @property
    def namespace(self) -> bytes | None:
        """The namespace the engine workers adopted, None before the first one did."""
        with self.locked():
            words = self.header[H_NAMESPACE : H_NAMESPACE + 2].tolist()
        return words_key(*words) if any(words) else None

    # ---- the persister's view ------------------------------------------------------

    def unpersisted(self, limit: int) -> list[tuple[Found, bytes, bytes, np.ndarray]]:
        """Up to ``limit`` valid blocks tier 3 may not have yet: (slot, key, parent, tokens)."""
        out = []
        with self.locked():
            m = self.meta
            keys = m[:, M_KEY_LO] | m[:, M_KEY_HI]
            todo = ((m[:, M_VERSION] & np.uint64(1)) == 0) & (keys != 0)
            todo &= (m[:, M_FLAGS] & np.uint64(F_PERSISTED)) == 0
            for s in np.flatnonzero(todo)[:limit]:
                s = int(s)
                key = words_key(m[s, M_KEY_LO], m[s, M_KEY_HI])
                parent = words_key(m[s, M_PAR_LO], m[s, M_PAR_HI])
                out.append((Found(s, int(m[s, M_VERSION])), key, parent, self.tokens[s].copy()))
        return out

    def mark_persisted(self, found: Found) -> None:
        with self.locked():
            if int(self.meta[found.slot, M_VERSION]) == found.version:
                self.meta[found.slot, M_FLAGS] |= np.uint64(F_PERSISTED)

    def num_valid(self) -> int:
        with self.locked():
            even = (self.meta[:, M_VERSION] & np.uint64(1)) == 0
            return int((even & ((self.meta[:, M_KEY_LO] | self.meta[:, M_KEY_HI]) != 0)).sum())


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def create_segment(nbytes: int) -> tuple[int, memoryview]:
    """An anonymous shared-memory file of ``nbytes`` (a memfd: it has no name to leak)
    and its mapping; children inherit the fd. For in-process servers and tests; the
    launcher makes its segment with ``transport.segment`` like every other."""
    import mmap

    fd = os.memfd_create("pdserve-kvtier", 0)
    os.ftruncate(fd, nbytes)
    return fd, memoryview(mmap.mmap(fd, nbytes, mmap.MAP_SHARED))
