"""What prefix blocks a worker holds, summarised in shared memory for the router.

Who does what:
    launcher   creates one segment per engine worker (``create_summary_segment``, sized by
               ``summary_counters`` from the pool it expects) before anything starts, and
               hands its fd to that worker and to the frontend (``ProcessSpec``).
    worker     ``PrefixSummary(buf).clear()`` at start, before it is READY (a restarted
               worker's pool is empty); then, every step, ``update(registered, evicted)``
               with the block hashes its allocator journaled (``BlockAllocator.
               take_hash_changes``). It is the segment's only writer.
    router     ``count_prefix(hashes)``: how many leading block hashes of a prompt the
               worker probably holds, read lock-free before a placement.

The structure: a counting Bloom filter. ``num_counters`` (a power of two) one-byte
counters; a 64-bit block hash ``h`` (``engine.kv.block_allocator.block_hashes``: blake2b, so
already uniform) names ``K`` counters by double hashing, ``(lo + i * hi) mod m`` with ``lo``
and ``hi`` its 32-bit halves (``hi`` forced odd). Adding a hash increments its counters,
removing one decrements them; a hash is reported held when all ``K`` are non-zero.

Why this and not an exact set (e.g. open addressing of the 64-bit hashes) or a seqlock:
- Fixed size, known before the worker starts: on a GPU the worker sizes its own pool, so
  the launcher cannot know the block count; a filter degrades gracefully (more false
  positives) when it holds more than planned, where a full hash table must drop entries.
- Incremental: a registration or an eviction touches K bytes; nothing is rebuilt.
- Deletions: counters, not bits, so an evicted block stops being reported.
- Torn reads: every counter is one byte and has one writer, and a byte store is
  single-copy atomic on every architecture, so a reader sees each counter either before
  or after a write - never garbage. A query racing an update can be wrong only about the
  hashes being added or removed at that moment (K counters are not written at once): a
  transient false positive or negative. No seqlock, so the reader never retries and the
  writer never waits. Routing is a guess either way: the worker's own allocator decides
  what is really reused, so a wrong summary costs a placement some expected reuse, never
  a wrong output.
- False positives: with n hashes in m counters the rate is (1 - e^(-Kn/m))^K: 2.4 % at
  n = m/8 (the launcher's sizing), 0.2 % at m/16. A prompt's hashes are walked until the
  first miss, so a false positive lengthens a prefix by one block only when it falls
  right at its end.
- Counters saturate at 255 and then stay (never decremented): practically unreachable,
  as a counter's expected load is K·n/m = 0.5.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from transport.segment import Segment

K = 4  # counters per hash: the rate above is lowest near K = (m/n) ln 2 ~ 5.5; 4 is cheaper
HEADER_NBYTES = 64
MIN_COUNTERS = 1 << 12
MAX_COUNTERS = 1 << 24  # 16 MiB: ~2M blocks at the planned load
_MAGIC = 0x7064_7072_6566_7831  # "pdprefx1"
_HEADER = struct.Struct("<QII")  # magic, num_counters, K
_SATURATED = 255


def summary_counters(num_blocks: int | None) -> int:
    """Counters for a pool of ``num_blocks`` (None: unknown, e.g. sized from GPU memory)."""
    if num_blocks is None:
        return 1 << 22  # 4 MiB: holds half a million blocks at the planned load
    want = 8 * max(1, num_blocks)
    return min(MAX_COUNTERS, max(MIN_COUNTERS, 1 << (want - 1).bit_length()))


def summary_nbytes(num_counters: int) -> int:
    return HEADER_NBYTES + num_counters


def create_summary_segment(tag: str, num_counters: int) -> Segment:
    return Segment.create(f"summary.{tag}", summary_nbytes(num_counters))


class PrefixSummary:
    """A view of one worker's summary over ``buf`` (the segment's mapping, or any buffer).

    The first constructor over a zero-filled buffer writes the header (``num_counters``
    must then be given); later ones read it.
    """

    def __init__(self, buf: object, num_counters: int | None = None) -> None:
        view = memoryview(buf).cast("B")  # type: ignore[arg-type]
        magic, m, k = _HEADER.unpack_from(view, 0)
        if magic == 0:
            if num_counters is None or num_counters & (num_counters - 1):
                raise ValueError(f"a new summary needs a power-of-two size, not {num_counters}")
            m, k = num_counters, K
            _HEADER.pack_into(view, 0, _MAGIC, m, k)
        elif magic != _MAGIC or k != K:
            raise ValueError(f"not a prefix summary (magic {magic:#x}, K {k})")
        if view.nbytes < summary_nbytes(m):
            raise ValueError(f"buffer of {view.nbytes} bytes for {m} counters")
        self.num_counters = m
        self._counters = np.frombuffer(view, np.uint8, m, HEADER_NBYTES)

    def _positions(self, hashes: Sequence[int]) -> np.ndarray:
        """(len(hashes), K) counter indices."""
        h = np.asarray(hashes, dtype=np.uint64)
        lo = h & np.uint64(0xFFFF_FFFF)
        hi = (h >> np.uint64(32)) | np.uint64(1)
        i = np.arange(K, dtype=np.uint64)
        mask = np.uint64(self.num_counters - 1)
        return ((lo[:, None] + i[None, :] * hi[:, None]) & mask).astype(np.intp)

    # ---- the worker's side ---------------------------------------------------------

    def clear(self) -> None:
        self._counters[:] = 0

    def update(self, added: Sequence[int], removed: Sequence[int]) -> None:
        """Count ``added`` hashes in, then ``removed`` ones out (each once per listing)."""
        if added:
            pos, n = np.unique(self._positions(added), return_counts=True)
            cur = self._counters[pos].astype(np.int32)
            self._counters[pos] = np.minimum(cur + n, _SATURATED)
        if removed:
            pos, n = np.unique(self._positions(removed), return_counts=True)
            cur = self._counters[pos].astype(np.int32)
            keep = cur == _SATURATED  # its true count is unknown: it stays saturated
            self._counters[pos] = np.where(keep, cur, np.maximum(cur - n, 0))

    # ---- the router's side ---------------------------------------------------------

    def contains(self, hashes: Sequence[int]) -> np.ndarray:
        """Per hash: probably held (True) or surely not (False)."""
        if not len(hashes):
            return np.zeros(0, dtype=bool)
        return (self._counters[self._positions(hashes)] > 0).all(axis=1)

    def count_prefix(self, hashes: Sequence[int]) -> int:
        """Leading ``hashes`` probably held: the blocks a prompt would reuse here."""
        held = self.contains(hashes)
        misses = np.flatnonzero(~held)
        return int(misses[0]) if misses.size else len(held)

    @property
    def load(self) -> float:
        """Fraction of non-zero counters (for tests and diagnostics)."""
        return float(np.count_nonzero(self._counters)) / self.num_counters
