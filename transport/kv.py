"""KV handoff: moving one request's KV blocks from a prefill pool into a decode pool.

Pool layout (both sides, ``wire.kv_layout.KVLayout``): ``(num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim)``, block-major, so block ``b`` is one contiguous byte range of
``block_nbytes`` and a run of consecutive block ids is one contiguous range.

Who calls what, when (i = prefill worker, j = decode worker):

  launcher, before spawning
      Creates, per prefill worker, the shared segment its transfers read from
      (``create_pool_segment``): the KV pool itself on CPU, a pinned staging mirror for
      the GPU ``shm`` backend, nothing for ``cuda_ipc``.
  prefill i, at startup
      Builds a ``KVExporter``. For ``cuda_ipc`` it sends ``exporter.handle()`` (bytes)
      to every decode worker once, as data (``records.KVPoolHandle``).
  prefill i, when a request's prefill is done
      ``exporter.export(blocks)`` - afterwards the blocks' bytes are readable by any
      decode worker (GPU work finished, staging filled). Then ``pinned.pin(rid, j,
      blocks)`` and a ``KVTransfer`` goes to j. Pinned blocks are neither written nor
      freed by prefill until released.
  decode j, on KVTransfer, once its allocator has room
      ``receiver.fetch(i, src_blocks, dst_blocks)`` - synchronous: when it returns, the
      destination blocks hold the bytes and the source blocks are no longer read. Then
      ``KVRelease(rid, accepted=True)`` goes back (``accepted=False`` when refused or
      aborted, without fetching).
  prefill i, on KVRelease
      ``pinned.on_release(rid)`` returns the blocks to free in its allocator.
  prefill i, every loop iteration (cheap)
      for each decode worker j whose release ring's peer has died while ``pinned`` holds
      blocks for it, ``pinned.on_peer_dead(j)`` returns them to free, so they are freed
      within a poll interval.

Only ``fetch`` and ``export`` touch KV bytes; ``PinnedBlocks`` is pure bookkeeping and
never frees anything itself. Errors in a request (bad ids, unknown source) raise
``KVTransferError``; the caller refuses that request only.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from transport.errors import KVTransferError
from transport.segment import Segment
from wire.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def create_pool_segment(tag: str, layout: KVLayout) -> Segment:
    """A pool's shared segment, not pre-committed: pages are taken as blocks are written."""
    return Segment.create(f"kv.{tag}", layout.nbytes, reserve=False)


def pool_view(segment: Segment, layout: KVLayout) -> torch.Tensor:
    """The segment as a pool tensor (CPU, shared, no copy). Keep ``segment`` open."""
    if segment.spec.nbytes < layout.nbytes:
        raise KVTransferError(f"segment of {segment.spec.nbytes} bytes < pool {layout.nbytes}")
    import torch  # not at the top: the launcher imports this module, and no torch

    flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=layout.nbytes)
    return flat.view(layout.torch_dtype).view(layout.shape)


def block_runs(src: Sequence[int], dst: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Coalesce (src, dst) block pairs into maximal (src_start, dst_start, length) runs."""
    if len(src) != len(dst):
        raise KVTransferError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    k = 0
    while k < len(src):
        n = 1
        while k + n < len(src) and src[k + n] == src[k] + n and dst[k + n] == dst[k] + n:
            n += 1
        yield src[k], dst[k], n
        k += n


def check_ids(blocks: Sequence[int], num_blocks: int, side: str) -> None:
    if blocks and (min(blocks) < 0 or max(blocks) >= num_blocks):
        raise KVTransferError(f"{side} block id out of range [0, {num_blocks}): {list(blocks)}")
    if len(set(blocks)) != len(blocks):
        raise KVTransferError(f"{side} block ids repeat: {list(blocks)}")


class KVExporter(abc.ABC):
    """Prefill side: makes pinned blocks readable by decode workers."""

    @abc.abstractmethod
    def export(self, blocks: Sequence[int]) -> None:
        """Called once per request, before its KVTransfer is sent. Blocks until done."""

    def handle(self) -> bytes:
        """Bytes decode workers need to map this pool (cuda_ipc only; others: empty)."""
        return b""


class KVRead(abc.ABC):
    """A copy ``KVReceiver.start_fetch`` began and has not finished: polled, never waited on,
    so a decode worker keeps stepping its running requests while KV crosses a network."""

    @abc.abstractmethod
    def poll(self) -> bool:
        """True once every destination block holds its source's bytes. Raises
        ``KVReadFailed`` if the copy failed or passed its deadline; then ``abandon``."""

    @abc.abstractmethod
    def abandon(self) -> bool:
        """Stop waiting (the request was aborted, or ``poll`` raised). True once nothing
        can write the destination blocks any more: only then may they be freed. A copy
        still in flight cannot be recalled (an RDMA read lands when it lands): False
        until it has ended, so the caller asks again later."""


class KVReceiver(abc.ABC):
    """Decode side: copies blocks from a prefill worker's pool into the local pool."""

    def start_fetch(
        self, src_worker: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> KVRead | None:
        """Begin ``fetch``; None when the copy is already complete. In-host backends copy at
        once (a memory copy costs less than a step); a network backend returns the read
        in flight. Refusals raise ``KVTransferError`` as ``fetch`` does."""
        self.fetch(src_worker, src_blocks, dst_blocks)
        return None

    @abc.abstractmethod
    def fetch(self, src_worker: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Copy ``src_blocks`` of prefill ``src_worker`` into local ``dst_blocks`` (pairwise).

        Mutates only the destination blocks. Synchronous: on return the copy is complete
        and the source may be freed. Raises KVTransferError for an unknown worker, a
        length mismatch or an id out of range; nothing is copied then.
        """


class PinnedBlocks:
    """Prefill-side record of blocks pinned for transfer, per request and per decode worker.

    Invariant: a rid is pinned at most once. A block may be pinned for several rids (a
    prefix block they share): each rid's pin is its own, and is dropped once.
    """

    def __init__(self) -> None:
        self._by_rid: dict[int, tuple[int, list[int]]] = {}
        self._by_decode: dict[int, set[int]] = {}

    def pin(self, rid: int, decode_worker: int, blocks: Sequence[int]) -> None:
        if rid in self._by_rid:
            raise ValueError(f"rid {rid} is already pinned")
        self._by_rid[rid] = (decode_worker, list(blocks))
        self._by_decode.setdefault(decode_worker, set()).add(rid)

    def on_release(self, rid: int) -> list[int]:
        """Blocks to free now that decode released ``rid``; [] if it was not pinned."""
        entry = self._by_rid.pop(rid, None)
        if entry is None:
            logger.warning("rid %d: KV release for blocks that are not pinned", rid)
            return []
        decode_worker, blocks = entry
        self._by_decode[decode_worker].discard(rid)
        return blocks

    def on_peer_dead(self, decode_worker: int) -> list[int]:
        """Blocks pinned for a decode worker that died: all of them, to free now."""
        freed: list[int] = []
        for rid in sorted(self._by_decode.pop(decode_worker, set())):
            freed.extend(self._by_rid.pop(rid)[1])
        if freed:
            logger.warning("decode %d died: freeing %d pinned blocks", decode_worker, len(freed))
        return freed

    def rids_for(self, decode_worker: int) -> set[int]:
        return set(self._by_decode.get(decode_worker, ()))

    @property
    def num_pinned(self) -> int:
        return sum(len(blocks) for _, blocks in self._by_rid.values())
