"""Copies between a CUDA KV pool and host memory, on a side stream, off the step.

Tier 2's slots are page-locked (``cudaHostRegister`` of the shared segment, in each
worker that maps it), so a block goes device -> slot and slot -> device by DMA, with no
pageable bounce and no host thread copying. Tier-3 reads land in pinned staging rows
and go up from there.

Ordering (the two hazards of copying beside the compute stream):
- *A store never reads a block the step is still writing*: ``to_host`` first makes the
  side stream wait for everything the compute stream was given so far (the forward that
  wrote the block), then copies.
- *A load never overwrites a block still being read*: a fresh pool block may have been
  freed by a sequence whose last step is still queued on the GPU; ``to_pool`` and the
  loader threads' ``upload`` run after ``order_after_compute`` (the same wait), taken when
  the blocks were reserved.
- The other way round, the caller keeps each block out of every step until the copy's
  future resolves: a stored block is held (one more reference: no eviction reuses it), a
  loaded one belongs to no block table until its load is settled. The future resolves on
  an event's host-side completion, so a step enqueued after that is ordered after the
  copy without a stream wait.

Completion is observed by one waiter thread blocking on events made with
``blocking=True`` (the thread sleeps in the driver; nothing spins), in copy order: the
side stream runs its copies in the order they were given.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

logger = logging.getLogger(__name__)

_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def pin_host_memory(arr: np.ndarray) -> bool:
    """Page-lock ``arr``'s memory for DMA in this process (unregistered when the returned
    registration's owner is collected by the caller); False if CUDA refused."""
    err = int(torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, 0))
    if err not in (0, _ALREADY_REGISTERED):
        logger.warning(
            "KV tier 2: cudaHostRegister of %d bytes failed (error %d): copies to and from "
            "host RAM will be pageable (slower, and synchronous for the host)",
            arr.nbytes,
            err,
        )
        return False
    return True


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class CudaCopier:
    """Block copies between ``pool`` (on a CUDA device) and host rows, on a side stream.

    ``slots``: tier 2's payload rows ``(slots, stride)`` u8, shared memory this process
    maps; they are page-locked here for the copier's lifetime.
    """

    def __init__(self, pool: torch.Tensor, slots: np.ndarray) -> None:
        assert pool.is_cuda and pool.is_contiguous()
        self.device = pool.device
        self.stream = torch.cuda.Stream(self.device)
        self.block_nbytes = pool[0].numel() * pool.element_size()
        self.pool_rows = pool.view(pool.shape[0], -1).view(torch.uint8)  # (N, block_nbytes)
        self.slot_rows = torch.from_numpy(slots)  # (slots, stride) u8, host
        if pin_host_memory(slots):
            weakref.finalize(self, _unpin, slots.ctypes.data)
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-copy")

    def order_after_compute(self) -> None:
        """Copies given to the side stream from now on wait for the compute stream's work
        so far (a GPU-side wait: the host does not block)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _done(self) -> Future[None]:
        ev = torch.cuda.Event(blocking=True)
        ev.record(self.stream)
        return self._waiter.submit(ev.synchronize)

    def _copy(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Future[None]:
        """``dst.copy_(src)`` for each ``(dst, src)`` on the side stream, after the compute
        stream's work so far; the future resolves once every copy is done."""
        self.order_after_compute()
        with torch.cuda.stream(self.stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        return self._done()

    def to_host(self, pairs: list[tuple[int, int]]) -> Future[None]:
        """Copy pool block -> tier-2 slot for each ``(block, slot)``; the future resolves
        once the bytes are in host memory."""
        n = self.block_nbytes
        return self._copy([(self.slot_rows[s, :n], self.pool_rows[b]) for b, s in pairs])

    def to_pool(self, pairs: list[tuple[int, int]]) -> Future[None]:
        """Copy tier-2 slot -> pool block for each ``(slot, block)``; the future resolves
        once the bytes are on the device."""
        n = self.block_nbytes
        return self._copy([(self.pool_rows[b], self.slot_rows[s, :n]) for s, b in pairs])

    def drain(self) -> None:
        """Return once every copy given so far is done and its callbacks have run."""
        self._waiter.submit(lambda: None).result()

    def staging(self, n: int) -> np.ndarray:
        """``(n, block_nbytes)`` u8 pinned host rows for tier-3 reads to land in."""
        rows = torch.empty((n, self.block_nbytes), dtype=torch.uint8, pin_memory=True)
        return rows.numpy()

    def upload(self, row: np.ndarray, block: int) -> None:
        """Copy a staging ``row`` into pool ``block`` and return once it is there (a
        loader thread's call; ``order_after_compute`` was called when ``block`` was
        reserved). The thread sleeps on the event; the GIL is released meanwhile."""
        with torch.cuda.stream(self.stream):
            self.pool_rows[block].copy_(torch.from_numpy(row), non_blocking=True)
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        ev.synchronize()
