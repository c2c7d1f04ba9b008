"""The one writer of a host's tier 3: copies tier-2 blocks to disk behind the workers.

Workers only ever *read* tier 3. Every block a worker stores in tier 2 is unpersisted
until this thread (in the launcher, or in an in-process server) has copied it out,
checked that the slot kept its version while it copied, and written its file; a block
tier 2 evicts before that is simply not on disk. So the write-behind window is bounded
by tier 2's size, a crash loses at most that window, and ``stop`` flushes it.

The writer owns the disk budget: it scans the directory at start (usage, LRU order by
mtime, leftover temp files deleted), evicts least recently used files (readers bump a
file's mtime on a hit: a file read since it was listed gets a second chance) to stay
within ``budget`` bytes and above ``min_free`` bytes free on the file system, and a
failed write (disk full, quota, read-only) drops the block and refunds its bytes.
While idle it wakes twice a second to look for new blocks (a few microseconds' work).

The blocks' namespace (tier 3's subdirectory and every file's header) is the one the engine
workers published in tier 2's header (``HostStore.adopt_namespace``), never one of its own:
the writer cannot know the order inside a block, which is the workers' attention backend's.
Until a worker has published it, tier 2 holds nothing to write.

A ``HostStore.clear`` (POST /reset_prefix_cache) moves tier 2's epoch; the writer then
deletes every file of its namespace and reports the epoch back (``disk_epoch``). A write
racing the clear (its slot checked just before it) lands before that deletion, which
therefore removes it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from engine.kv.tiers.disk_store import SUFFIX, TMP_SUFFIX, DiskStore
from engine.kv.tiers.host_store import HostStore

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
BATCH = 64


class Persister:
    """Tier 3's writer; ``start()`` its thread, ``stop()`` flushes and joins it."""

    def __init__(self, host: HostStore, root: Path, budget: int, min_free: int) -> None:
        self.host, self.root = host, root
        self._disk: DiskStore | None = None
        self.budget, self.min_free = budget, min_free
        self.files: OrderedDict[Path, tuple[int, float]] = OrderedDict()  # LRU first
        self.usage = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-persister", daemon=True)
        self._epoch = host.epoch  # tier 2's clear epoch the disk has caught up with
        host.set_disk_epoch(self._epoch)
        self.scan()

    @property
    def disk(self) -> DiskStore | None:
        """The files of the workers' namespace; None until a worker has published it."""
        if self._disk is None:
            ns = self.host.namespace
            if ns is not None:
                g = self.host.geometry
                self._disk = DiskStore(self.root, ns, g.block_size, g.payload_nbytes)
        return self._disk

    def scan(self) -> None:
        """Rebuild usage and LRU order from the directory; delete leftover temp files."""
        found: list[tuple[float, Path, int]] = []
        removed = 0
        if self.root.exists():
            for dirpath, _dirs, names in os.walk(self.root):
                if Path(dirpath).name == "quarantine":
                    continue
                for name in names:
                    p = Path(dirpath) / name
                    try:
                        if name.endswith(TMP_SUFFIX):
                            p.unlink()
                            removed += 1
                        elif name.endswith(SUFFIX):
                            st = p.stat()
                            found.append((st.st_mtime, p, st.st_size))
                    except OSError:
                        continue
        found.sort()
        self.files = OrderedDict((p, (size, mtime)) for mtime, p, size in found)
        self.usage = sum(size for _, _, size in found)
        logger.info(
            "KV tier 3 at %s: %d block files, %.1f MiB; %d temp files removed",
            self.root,
            len(found),
            self.usage / (1 << 20),
            removed,
        )
        self._publish()
        self._evict(0)

    def clear(self) -> int:
        """Delete every block file of this namespace (tier 2 was cleared); files deleted."""
        deleted, disk = 0, self.disk
        if disk is None:  # no worker has named blocks yet: none of this namespace to delete
            return 0
        for dirpath, _dirs, names in os.walk(disk.dir):
            for name in names:
                if name.endswith((SUFFIX, TMP_SUFFIX)):
                    with contextlib.suppress(OSError):
                        (Path(dirpath) / name).unlink()
                        deleted += 1
        logger.info("KV tier 3 cleared: %d files of %s deleted", deleted, disk.dir)
        self.scan()  # usage and LRU order of what is left (other namespaces)
        return deleted

    def start(self) -> None:
        self._thread.start()

    def stop(self, flush: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if flush:
            while self.persist_some():
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.persist_some():
                self._stop.wait(IDLE_POLL_S)

    def persist_some(self) -> int:
        """Write up to one batch of unpersisted tier-2 blocks; how many were looked at."""
        epoch = self.host.epoch
        if epoch != self._epoch:
            self.clear()
            self._epoch = epoch
            self.host.set_disk_epoch(epoch)
        disk = self.disk
        batch = [] if disk is None else self.host.unpersisted(BATCH)
        for found, key, parent, tokens in batch:
            assert disk is not None
            path = disk.path(key)
            if path in self.files or path.exists():
                self.host.mark_persisted(found)
                continue
            payload = self.host.payload[found.slot, : disk.payload_nbytes].copy()
            if self.host.still_valid([found]) != 1:
                continue  # evicted while copied: nothing to write
            self._write(disk, key, parent, tokens, payload, path)
            self.host.mark_persisted(found)  # written, or dropped for good (disk full)
        if batch:
            self._publish()
        return len(batch)

    def _write(
        self,
        disk: DiskStore,
        key: bytes,
        parent: bytes,
        tokens: np.ndarray,
        payload: np.ndarray,
        path: Path,
    ) -> None:
        size = disk.file_nbytes
        if not self._evict(size):
            self.host.set_counter("disk_dropped", self._counter("disk_dropped") + 1)
            return
        t0 = time.perf_counter_ns()
        try:
            written = disk.write(key, parent, tokens, payload)
        except OSError as e:
            logger.warning("KV tier 3: cannot write a block (%s); it stays off disk", e)
            with self.host.locked():
                self.host.count("disk_dropped", 1)
            return
        if written:
            self.files[path] = (written, time.time())
            self.usage += written
            with self.host.locked():
                self.host.count("disk_bytes_written", written)
                self.host.count("disk_store_ns", time.perf_counter_ns() - t0)

    def _counter(self, name: str) -> int:
        return self.host.counters()[name]

    def _evict(self, room: int) -> bool:
        """Delete LRU files until ``room`` more bytes fit the budget and the free-space
        watermark; False if they cannot (the budget is smaller than one file)."""
        evicted = 0
        while self.files and (
            self.usage + room > self.budget or self._free() - room < self.min_free
        ):
            path, (size, seen) = next(iter(self.files.items()))
            try:
                mtime = path.stat().st_mtime
            except OSError:
                mtime = None  # gone (quarantined by a reader): just forget it
            if mtime is not None and mtime > seen:  # read since listed: second chance
                self.files.move_to_end(path)
                self.files[path] = (size, mtime)
                continue
            del self.files[path]
            self.usage -= size
            path.unlink(missing_ok=True)
            evicted += 1
        if evicted:
            with self.host.locked():
                self.host.count("disk_evictions", evicted)
        return self.usage + room <= self.budget and self._free() - room >= self.min_free

    def _free(self) -> int:
        try:
            st = os.statvfs(self.root if self.root.exists() else self.root.parent)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _publish(self) -> None:
        self.host.set_counter("disk_usage_bytes", self.usage)
        self.host.set_counter("disk_files", len(self.files))
