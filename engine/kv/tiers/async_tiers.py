"""The tiers for a pool whose copies run beside the step (a CUDA pool): stores and loads
are handed to a copier (``cuda_copy.CudaCopier``) and finish later.

Who waits for what:
- ``offer``: each new block's tier-2 slot is claimed (BEING WRITTEN: no lookup finds it),
  the copier copies pool -> slot, and when that is done the slot is published and the
  pool block is let go. Until then the caller holds one more reference on the block
  (``offer`` returns them), so no eviction hands it to another sequence to overwrite;
  ``take_released`` gives the references back once their copies are done.
- ``load``: tier 2's run is copied slot -> fresh pool blocks and tier 3's files are read
  into pinned staging and uploaded, all off the step; the load comes back *pending* and
  the caller parks the sequence (as a CPU pool does for tier 3 alone). ``settle`` then
  checks that each tier-2 slot kept its version while it was copied (a slot reused
  meanwhile ends the run: a miss, never wrong bytes), keeps the leading run that arrived
  intact, frees the rest, and only then counts hits.
- ``PendingLoad.cancel`` (abort, preemption) waits for the copies in flight before the
  blocks go back: a block freed under a running DMA could be handed out and written.

The bookkeeping needs only futures, so it runs (and is tested) on CPU with any copier
that honours the same contract.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from engine.kv.sequence import Sequence
from engine.kv.tiers.disk_load import DiskLoad, DiskLoader, InFlight
from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import Claim, Found, HostStore
from engine.kv.tiers.tiered import TieredKV, TierLoad

logger = logging.getLogger(__name__)


class BlockCopier(Protocol):
    """What ``AsyncTieredKV`` needs of a device (``cuda_copy.CudaCopier``)."""

    def order_after_compute(self) -> None: ...
    def to_host(self, pairs: list[tuple[int, int]]) -> Future[None]: ...
    def to_pool(self, pairs: list[tuple[int, int]]) -> Future[None]: ...
    def staging(self, n: int) -> np.ndarray: ...
    def drain(self) -> None: ...
    def upload(self, row: np.ndarray, block: int) -> None: ...


@dataclass
class HostCopy:
    """A tier-2 run being copied into the pool: ``blocks[i]`` gets slot ``found[i]``."""

    found: list[Found]
    blocks: list[int]
    copied: Future[None]
    asked: int  # blocks the lookup asked tier 2 for (the rest are misses)
    started_ns: int


@dataclass
class PendingLoad:
    """One sequence's tier loads in flight: tier 2's run, then tier 3's after it."""

    first: int  # index of the sequence's first block loaded
    host: HostCopy | None
    disk: DiskLoad | None
    free: Callable[[list[int]], None]

    def _futures(self) -> list[Future[Any]]:
        out: list[Future[Any]] = []
        if self.host is not None:
            out.append(self.host.copied)
        if self.disk is not None:
            out += self.disk.futures
        return out

    def done(self) -> bool:
        return all(f.done() for f in self._futures())

    def wait(self, timeout_s: float | None = None) -> bool:
        return not wait(self._futures(), timeout_s).not_done

    def cancel(self) -> None:
        if self.host is not None:
            wait([self.host.copied])  # a DMA in flight still writes these blocks
            self.free(self.host.blocks)
        if self.disk is not None:
            self.disk.cancel()


class AsyncTieredKV(TieredKV):
    """``TieredKV`` whose copies to and from the pool run off the step (see the module)."""

    def __init__(
        self,
        host: HostStore,
        disk: DiskStore | None,
        namespace: bytes,
        pool: torch.Tensor,
        copier: BlockCopier,
    ) -> None:
        super().__init__(host, disk, namespace, pool)
        self.copier = copier
        self.loader = None if disk is None else DiskLoader(disk, host, copier.upload)

    # ---- stores --------------------------------------------------------------------

    def offer(self, seq: Sequence, first: int, end: int) -> list[int]:
        """Start copying ``seq``'s full blocks ``first..end-1`` into tier 2; the pool
        blocks the copies read, on which the caller must take one reference each until
        ``take_released`` returns them."""
        keys = self.keys(seq, end)
        tokens = self._tokens(seq, first, end)
        claims: list[tuple[Claim, int]] = []
        for i in range(first, end):
            claim = self.host.begin_put(keys[i])
            if claim is not None:
                claims.append((claim, i))
        if not claims:
            return []
        blocks = [seq.block_table[i] for _, i in claims]
        parents = [self._parent(seq, i) for _, i in claims]
        rows = [tokens[i - first] for _, i in claims]
        copied = self.copier.to_host(
            [(b, c.slot) for b, (c, _) in zip(blocks, claims, strict=True)]
        )

        def publish(f: Future[None]) -> None:  # on the copier's thread, or here if done
            ok = f.exception() is None
            if not ok:
                logger.error("KV tier 2: a store copy failed: %s", f.exception())
            for (c, _), parent, row in zip(claims, parents, rows, strict=True):
                self.host.end_put(c, parent, row, self.block_nbytes, ok)
            self._released.append(blocks)

        copied.add_done_callback(publish)
        return blocks

    def flush(self) -> None:
        """Return once every store given so far is published in tier 2."""
        self.copier.drain()
        super().flush()

    # ---- loads ---------------------------------------------------------------------

    def load(
        self,
        seq: Sequence,
        first: int,
        end: int,
        allocate: Callable[[int], list[int]],
        free: Callable[[list[int]], None],
        wait: bool = True,
    ) -> TierLoad:
        """Start copying the tiers' run of ``seq``'s blocks ``first..end-1`` into fresh
        pool blocks; pending unless ``wait`` (then settled before returning)."""
        if first >= end:
            return TierLoad([])
        keys = self.keys(seq, end)[first:end]
        tokens = self._tokens(seq, first, end)
        t0 = time.perf_counter_ns()
        found = self.host.lookup(keys, tokens)
        blocks = allocate(len(found)) if found else []
        room = len(blocks) == len(found)  # tier 3 continues the run only if all fit
        found = found[: len(blocks)]
        host = None
        if blocks:
            copied = self.copier.to_pool([(f.slot, b) for f, b in zip(found, blocks, strict=True)])
            host = HostCopy(found, blocks, copied, len(keys), t0)
        else:
            self.host.count_lookup(0, len(keys), 0, time.perf_counter_ns() - t0)
        disk = None
        if room and self.disk is not None:
            disk = self._start_disk(seq, first + len(found), first, keys, tokens, allocate, free)
        if host is None and disk is None:
            return TierLoad([])
        pending = PendingLoad(first, host, disk, free)
        if not wait:
            return TierLoad([], pending=pending)
        got = self.settle(pending)
        n_host = min(len(got), len(found))
        return TierLoad(got, from_host=n_host, from_disk=len(got) - n_host)

    def _read_targets(self, blocks: list[int]) -> list[np.ndarray]:
        # Uploads into the blocks reserved now wait for the steps already given to the GPU.
        self.copier.order_after_compute()
        staging = self.copier.staging(len(blocks))
        return [staging[i] for i in range(len(blocks))]

    def settle(self, load: InFlight) -> list[int]:
        """The pool blocks ``load`` filled intact, in order (the rest freed); counted."""
        if not isinstance(load, PendingLoad):
            return super().settle(load)
        load.wait()
        blocks: list[int] = []
        if load.host is not None:
            h, ok = load.host, 0
            if h.copied.exception() is None:
                ok = self.host.still_valid(h.found)
            else:
                logger.error("KV tier 2: a load copy failed: %s", h.copied.exception())
            ns = time.perf_counter_ns() - h.started_ns
            self.host.count_lookup(ok, h.asked - ok, ok * self.block_nbytes, ns)
            load.free(h.blocks[ok:])
            blocks = h.blocks[:ok]
            if ok < len(h.found):  # the run ends here: tier 3's blocks after it are unused
                if load.disk is not None:
                    load.disk.cancel()
                return blocks
        if load.disk is not None:
            blocks += super().settle(load.disk)
        return blocks
