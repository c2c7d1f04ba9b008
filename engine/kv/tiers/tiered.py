"""What the runner calls: offer full blocks to the tiers, load a prefix's blocks back.

``offer`` claims a tier-2 slot for each newly registered block of a sequence (a block
tier 2 holds already costs one locked lookup) and ``store_offered`` copies them (a memcpy
each). The pool calls the two back to back, or, where its owner sends a step's tokens
first (``KVPool.defer_tier_stores``: the workers' loops), after the step: a 256-token
prompt's 16 stores, ~4 ms while a fresh tier 2 faults its pages in, are then off its TTFT.

``load`` is asked, on a pool miss, for the blocks after the pool's hits: it takes the
longest run of consecutive tier-2 hits, then continues with tier 3 from where tier 2
stopped, and copies each into a fresh pool block the caller allocated. A block whose copy
fails its check (tier 2: the slot was reused while copied; tier 3: any check of
``disk_store``) ends the run there: the blocks before it are kept, the rest are
recomputed, and only blocks that arrived intact are counted as hits. A tier-3 hit is
stored in tier 2 too, so the host's other workers find it fast: after the load, off the
step and off the request's path (``promote``), since the first stores into a fresh tier 2
(after a restart) fault its pages in, ~8 us a page here.

A tier-2 load is copied inside the caller's step (a memcpy: a 4k-token history in a few ms).
Tier 3 is read by loader threads (``disk_load.py``) into blocks reserved for the files
that exist: with ``wait=False`` the load is returned pending and the caller parks the
sequence until ``settle``, so other requests keep stepping meanwhile.

This class serves a CPU pool. A CUDA pool gets ``async_tiers.AsyncTieredKV``: its copies
to and from tier 2 run on a side stream, and tier 2 too is loaded off the step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.kv.sequence import Sequence
from engine.kv.tiers.disk_load import BlockRead, DiskLoad, DiskLoader, InFlight
from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import Claim, HostStore
from engine.kv.tiers.keys import chain_keys, root_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Store:
    """One offered block whose copy into its claimed tier-2 slot is still to run."""

    claim: Claim
    parent: bytes
    tokens: np.ndarray  # (block_size,) u32
    block: int  # the pool block read: held by the caller until ``take_released``


@dataclass
class TierLoad:
    """Blocks a load brought into the pool, by tier."""

    blocks: list[int]
    from_host: int = 0
    from_disk: int = 0
    pending: InFlight | None = None  # copies or reads still in flight (``settle`` them)


class TieredKV:
    def __init__(
        self, host: HostStore, disk: DiskStore | None, namespace: bytes, pool: torch.Tensor
    ) -> None:
        self.host, self.disk, self.namespace, self.pool = host, disk, namespace, pool
        self.block_size = int(pool.shape[3])
        self.block_nbytes = pool[0].numel() * pool.element_size()
        g = host.geometry
        if g.block_size != self.block_size or g.payload_nbytes != self.block_nbytes:
            raise ValueError(
                f"the host's KV tier holds blocks of {g.block_size} tokens, {g.payload_nbytes} "
                f"bytes; this pool's are {self.block_size} tokens, {self.block_nbytes} bytes"
            )
        self.loader = None if disk is None else DiskLoader(disk, host)
        self._quarantined = 0  # of disk.quarantined, what the host's counter has (settle)
        # Tier-3 blocks settled into the pool, not yet promoted to tier 2 (``promote``).
        self._settled: list[BlockRead] = []
        self._promoter: ThreadPoolExecutor | None = None
        # Pool blocks whose copies to tier 2 are done, to be given back by the caller.
        self._released: deque[list[int]] = deque()
        # Offered blocks, their slots claimed, not yet copied (``store_offered``).
        self._offered: deque[list[_Store]] = deque()

    def _block_bytes(self, block: int) -> np.ndarray:
        """Pool block ``block`` as u8, a view (a CPU pool)."""
        return self.pool[block].view(-1).view(torch.uint8).numpy()

    def keys(self, seq: Sequence, n: int) -> list[bytes]:
        """The tier keys of ``seq``'s first ``n`` full blocks (extending ``seq.tier_keys``)."""
        have, bs = len(seq.tier_keys), self.block_size
        if have < n:
            parent = seq.tier_keys[-1] if have else root_key(self.namespace, seq.hash_extra)
            tokens = seq.all_ids[have * bs : n * bs]
            seq.tier_keys += chain_keys(parent, tokens, bs)
        return seq.tier_keys[:n]

    def _tokens(self, seq: Sequence, first: int, end: int) -> np.ndarray:
        bs = self.block_size
        ids = seq.all_ids[first * bs : end * bs]
        return np.asarray(ids, dtype="<u4").reshape(end - first, bs)

    def _parent(self, seq: Sequence, i: int) -> bytes:
        return seq.tier_keys[i - 1] if i else root_key(self.namespace, seq.hash_extra)

    def offer(self, seq: Sequence, first: int, end: int) -> list[int]:
        """Claim tier-2 slots for ``seq``'s full blocks ``first..end-1`` (their KV is
        computed); ``store_offered`` copies them. Until then a claimed slot is BEING WRITTEN
        (every lookup misses it). Returns the pool blocks the copies will read: the caller
        holds one reference on each until ``take_released`` returns it, so no eviction
        hands one out to be overwritten meanwhile."""
        keys = self.keys(seq, end)
        tokens = self._tokens(seq, first, end)
        stores = []
        for i in range(first, end):
            claim = self.host.begin_put(keys[i])  # None: held already, or being written
            if claim is not None:
                block = seq.block_table[i]
                stores.append(_Store(claim, self._parent(seq, i), tokens[i - first], block))
        if stores:
            self._offered.append(stores)
        return [s.block for s in stores]

    def store_offered(self) -> None:
        """Copy every block offered so far into its slot and publish it there."""
        nbytes = self.block_nbytes
        while self._offered:
            stores = self._offered.popleft()
            for s in stores:
                # The counters time the copy, not how long the claim waited for it.
                claim = replace(s.claim, started_ns=time.perf_counter_ns())
                try:
                    self.host.payload[claim.slot, :nbytes] = self._block_bytes(s.block)
                except Exception:  # tier 2 is a cache: a block not stored is recomputed
                    logger.exception("KV tier 2: storing block %d failed", s.block)
                    self.host.end_put(claim, s.parent, s.tokens, nbytes, ok=False)
                else:
                    self.host.end_put(claim, s.parent, s.tokens, nbytes)
            self._released.append([s.block for s in stores])

    def take_released(self) -> list[int]:
        """Pool blocks ``offer`` or ``promote`` returned whose copies to tier 2 have
        finished since the last call (one reference each, taken by the caller)."""
        out: list[int] = []
        while self._released:
            out += self._released.popleft()
        return out

    def flush(self) -> None:
        """Return once every block given to tier 2 so far is stored there."""
        self.store_offered()
        if self._promoter is not None:
            self._promoter.submit(lambda: None).result()  # one thread: runs after the rest

    def promote(self) -> list[int]:
        """Start storing the tier-3 blocks settled since the last call into tier 2, on a
        thread of its own; the pool blocks it reads, on which the caller takes one
        reference each (so no eviction hands one out to be overwritten meanwhile) until
        ``take_released`` returns them."""
        reads, self._settled = self._settled, []
        if not reads:
            return []
        if self._promoter is None:
            self._promoter = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-promote")
        blocks = [r.block for r in reads]

        def store() -> None:
            try:
                for r in reads:
                    if not self.host.contains(r.key):
                        self.host.put(r.key, r.parent, r.tokens, r.dst)
            except Exception:  # tier 2 is a cache: a block not promoted is read from disk
                logger.exception("KV tier 2: promoting tier-3 blocks failed")
            finally:
                self._released.append(blocks)

        self._promoter.submit(store)
        return blocks

    def load(
        self,
        seq: Sequence,
        first: int,
        end: int,
        allocate: Callable[[int], list[int]],
        free: Callable[[list[int]], None],
        wait: bool = True,
    ) -> TierLoad:
        """Copy the longest run of ``seq``'s blocks ``first..end-1`` the tiers hold into
        pool blocks from ``allocate``; what did not arrive intact goes back to ``free``.
        ``wait=False``: tier-3 reads may still run on return (``TierLoad.pending``)."""
        if first >= end:
            return TierLoad([])
        keys = self.keys(seq, end)[first:end]
        tokens = self._tokens(seq, first, end)
        t0 = time.perf_counter_ns()
        found = self.host.lookup(keys, tokens)
        if not found and self.disk is None:
            self.host.count_lookup(0, len(keys), 0, time.perf_counter_ns() - t0)
            return TierLoad([])
        blocks = allocate(len(found))  # fewer if the pool has no more room
        found = found[: len(blocks)]
        for f, b in zip(found, blocks, strict=True):
            self._block_bytes(b)[:] = self.host.payload[f.slot, : self.block_nbytes]
        ok = self.host.still_valid(found)
        self.host.count_lookup(
            ok, len(keys) - ok, ok * self.block_nbytes, time.perf_counter_ns() - t0
        )
        free(blocks[ok:])
        out = TierLoad(blocks[:ok], from_host=ok)
        if ok == len(found) == len(blocks) and self.disk is not None:
            out.pending = self._start_disk(seq, first + ok, first, keys, tokens, allocate, free)
            if wait and out.pending is not None:
                out.blocks += self.settle(out.pending)
                out.from_disk, out.pending = len(out.blocks) - ok, None
        return out

    def _start_disk(
        self,
        seq: Sequence,
        i0: int,
        first: int,
        keys: list[bytes],
        tokens: np.ndarray,
        allocate: Callable[[int], list[int]],
        free: Callable[[list[int]], None],
    ) -> DiskLoad | None:
        """Reserve a pool block for each file of the run from block ``i0`` that exists and
        start reading them; None if there is nothing to read (a miss, counted)."""
        assert self.disk is not None and self.loader is not None
        end, n = first + len(keys), 0
        while i0 + n < end and self.disk.path(keys[i0 + n - first]).exists():
            n += 1
        blocks = allocate(n) if n else []
        if not blocks:
            with self.host.locked():
                self.host.count("disk_miss_blocks", end - i0)
            return None
        reads = [
            BlockRead(keys[i - first], self._parent(seq, i), tokens[i - first], b, dst)
            for i, b, dst in zip(range(i0, end), blocks, self._read_targets(blocks), strict=False)
        ]
        load = self.loader.start(i0, reads, free)
        load.wanted = end - i0
        return load

    def _read_targets(self, blocks: list[int]) -> list[np.ndarray]:
        """Where tier-3 reads for ``blocks`` land: the pool blocks themselves (fresh,
        private: no step touches them until the load is settled)."""
        return [self._block_bytes(b) for b in blocks]

    def settle(self, load: InFlight) -> list[int]:
        """The pool blocks ``load`` filled intact (a leading run; the rest were freed),
        counted as tier-3 hits once they are known to be."""
        assert self.disk is not None and isinstance(load, DiskLoad)
        blocks = load.settle()
        if self.loader is not None and self.loader.upload is None:  # else promoted already
            self._settled += load.reads[: len(blocks)]
        bad, self._quarantined = self.disk.quarantined - self._quarantined, self.disk.quarantined
        with self.host.locked():
            self.host.count("disk_hit_blocks", len(blocks))
            self.host.count("disk_miss_blocks", load.wanted - len(blocks))
            self.host.count("disk_bytes_read", len(blocks) * self.block_nbytes)
            self.host.count("disk_load_ns", max(0, load.finished_ns - load.started_ns))
            self.host.count("disk_quarantined", bad)
        return blocks
