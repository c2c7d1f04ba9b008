"""A run of tier-3 blocks read into the pool off the step, by a few loader threads.

A 4k-token history is ~256 files: read one after another inside a step, they would stall
every other request on the worker (a co-located worker's decodes too) for as long as the
disk takes. Instead the runner reserves one fresh pool block per file that exists, hands
the reads to ``READERS`` threads (several reads in flight is also what lets a disk reach
its own rate: one file at a time leaves it idle between requests), and parks the
sequence; the scheduler keeps stepping the others and asks again next step.

Invariants:
- A reserved block belongs to this load alone until ``settle`` or ``cancel``: no block
  table names it, so no step reads or writes it while a thread fills it. (A CUDA pool's
  reads land in pinned staging rows, and the thread's ``upload`` puts each on the device
  before its read counts as done: ``async_tiers.py``.)
- ``settle`` keeps the leading run of blocks that arrived intact and frees the rest: a
  failure partway keeps the blocks before it, and only kept blocks count as hits.
- ``cancel`` (the request was aborted or preempted) stops the reads not yet begun, waits
  for those in flight, and frees every reserved block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import HostStore

READERS = 16  # reads in flight per worker: 4, 8, 16, 32 measured in benchmarks/results/kv_tiers.md

logger = logging.getLogger(__name__)


class InFlight(Protocol):
    """A sequence's tier load still running (``DiskLoad``, ``async_tiers.PendingLoad``):
    the sequence is parked until the tiers settle it."""

    first: int  # index of the sequence's first block loaded

    def done(self) -> bool: ...
    def wait(self, timeout_s: float | None = None) -> bool: ...
    def cancel(self) -> None: ...


@dataclass(frozen=True)
class BlockRead:
    """One file to read into pool block ``block`` (``dst``: its bytes, u8)."""

    key: bytes
    parent: bytes
    tokens: np.ndarray  # (block_size,) u32
    block: int
    dst: np.ndarray


@dataclass
class DiskLoad:
    """One sequence's tier-3 reads; ``first`` is the index of the first block read."""

    first: int
    reads: list[BlockRead]
    futures: list[Future[bool]]
    free: Callable[[list[int]], None]
    wanted: int = 0  # blocks the run asked tier 3 for (those after the last hit are misses)
    started_ns: int = field(default_factory=time.perf_counter_ns)
    finished_ns: int = 0  # when the last read ended (the load's own time, not the park's)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, timeout_s: float | None = None) -> bool:
        return not wait(self.futures, timeout_s).not_done

    def settle(self) -> list[int]:
        """Wait for every read; keep the leading blocks that arrived intact (their ids),
        free the others."""
        self.wait()
        ok = 0
        while ok < len(self.futures) and self.futures[ok].result():
            ok += 1
        self.free([r.block for r in self.reads[ok:]])
        return [r.block for r in self.reads[:ok]]

    def cancel(self) -> None:
        self.cancelled.set()
        self.wait()
        self.free([r.block for r in self.reads])


class DiskLoader:
    """The loader threads of one worker's tiers (started on first use, daemon)."""

    def __init__(
        self,
        disk: DiskStore,
        host: HostStore,
        upload: Callable[[np.ndarray, int], None] | None = None,
    ) -> None:
        """``upload(dst, block)``: after a read passed its checks, put ``dst``'s bytes into
        pool block ``block`` and return once they are there, and promote them to tier 2
        (None: ``dst`` is the block, promoted after the load by ``TieredKV.promote``)."""
        self.disk, self.host, self.upload = disk, host, upload
        self._pool: ThreadPoolExecutor | None = None

    def start(
        self, first: int, reads: list[BlockRead], free: Callable[[list[int]], None]
    ) -> DiskLoad:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="kv-tier-read")
        load = DiskLoad(first, reads, [], free)
        load.futures = [self._pool.submit(self._read, r, load) for r in reads]
        return load

    def _read(self, r: BlockRead, load: DiskLoad) -> bool:
        try:
            if load.cancelled.is_set() or not self.disk.read(r.key, r.parent, r.tokens, r.dst):
                return False
            if self.upload is not None:
                self.upload(r.dst, r.block)
                # ``dst`` is a staging row the next load reuses: promote to tier 2 now.
                self.host.put(r.key, r.parent, r.tokens, r.dst)
            return True
        except Exception:  # a device copy failed: a miss, the block recomputed
            logger.exception("KV tier 3: loading block %s into the pool failed", r.key.hex())
            return False
        finally:
            load.finished_ns = max(load.finished_ns, time.perf_counter_ns())
