"""The ``nixl`` KV backend: a decode worker on another host pulls a handoff's blocks from
a prefill worker's pool with one NIXL READ, and tells the prefill side it may free them.

Same shape as the in-host backends (``transport/kv.py`` says who calls what, when):

  prefill i, at startup
      ``NixlExporter(pool, layout, name)`` registers the whole pool with a NIXL agent of
      its own (DRAM on CPU, VRAM on a GPU, so a fabric with GPUDirect RDMA reads device
      memory directly). ``handle()`` is what decode workers need to read it: the agent's
      metadata, the pool's base address and its layout. It travels once per decode
      process as ``KVPoolHandle``, like a ``cuda_ipc`` handle (``transport/kv_handles.py``
      keeps that bookkeeping for both).
  decode j, on that handle
      ``NixlReceiver.open(i, handle)`` refuses a pool whose layout differs from its own
      in anything but the block count (``KVLayoutMismatch`` names the fields), adds the
      remote agent and prepares one descriptor per remote block.
  decode j, on a KVTransfer
      ``start_fetch(i, src_blocks, dst_blocks, notify=...)``: one READ whose descriptors
      are the block pairs (NIXL merges adjacent ones), posted and returned in flight; the
      decode scheduler polls it between steps until it lands or fails (a deadline bounds
      it), so decode never stops for a network copy. ``fetch`` waits for it. A partial
      handoff (a prefix-cache hit) passes only the blocks it lacks and moves only those.
      ``notify`` (an encoded ``KVRelease``, ``release_notification``) is delivered to
      the prefill agent once the bytes have landed.
  prefill i
      ``releases()`` returns the ``KVRelease`` records that arrived that way. (Serving
      sends its releases on the release rings instead, through the gateways, refused
      ones alike; the handoff benchmark uses this path.)

Descriptors are whole blocks: the pool is block-major, ``(num_blocks, layers, 2,
block_size, kv_heads, head_dim)``, so block ``b`` is ``block_nbytes`` at ``base + b *
block_nbytes`` on both sides and the two sides' block counts may differ.

NIXL is an optional extra (``pip install 'pdserve[nixl]'``): nothing on a single host
imports this module, and constructing either end without it raises ``NixlUnavailable``
(``transport/nixl_agent.py`` loads NIXL and makes its agents).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from transport.errors import KVReadFailed, KVTransferError
from transport.kv import KVExporter, KVRead, KVReceiver, check_ids
from transport.nixl_agent import (
    Progress,
    check_compatible,
    load_nixl,
    new_agent,
    nixl_errors,
)
from wire.kv_layout import KVLayout
from wire.records import KVRelease, encode

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SPIN_POLLS = 64  # state checks before the wait starts sleeping: most reads finish in these
_POLL_SLEEP_S = 0.0002
# A notification with no READ is progressed for this long and at least this many polls: on
# a busy host 50 ms of wall time can hold only a few polls, too few to connect and send.
_NOTIF_FLUSH_S = 0.05
_NOTIF_FLUSH_POLLS = 256


class NixlPool(msgspec.Struct, array_like=True, frozen=True):
    """What a decode worker needs to read a prefill pool: ``NixlExporter.handle()``."""

    agent: str
    metadata: bytes
    layout: str  # KVLayout.to_json()
    base: int  # address of block 0 in the prefill process
    mem: str  # "DRAM" or "VRAM"
    device: int


def _pool_region(pool: torch.Tensor, layout: KVLayout) -> tuple[str, int]:
    if tuple(pool.shape) != layout.shape or pool.dtype != layout.torch_dtype:
        raise KVTransferError(
            f"pool {tuple(pool.shape)} {pool.dtype} is not layout {layout.shape} {layout.dtype}"
        )
    if not pool.is_contiguous():
        raise KVTransferError("the nixl backend needs a contiguous pool")
    return ("VRAM" if pool.is_cuda else "DRAM"), (pool.device.index or 0) if pool.is_cuda else 0


def _block_descs(base: int, blocks: int, block_nbytes: int, device: int) -> np.ndarray:
    """One (address, length, device) row per block: NIXL's Nx3 descriptor list."""
    addrs = base + np.arange(blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    out = np.empty((blocks, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, block_nbytes, device
    return out


class NixlExporter(KVExporter):
    """Prefill side: the pool registered with this worker's NIXL agent.

    ``name`` must be unique among the agents a decode worker talks to, and differ for a
    restarted process (decode tells pools apart by the handle's bytes): e.g. the node,
    role, index and pid. The owner calls ``serve_reads(True)`` while any handoff of this
    pool may be read (blocks pinned for a remote decode worker), ``False`` otherwise.
    """

    def __init__(
        self, pool: torch.Tensor, layout: KVLayout, name: str, nixl: ModuleType | None = None
    ) -> None:
        nixl = nixl or load_nixl()
        self.pool, self.layout = pool, layout
        self.mem, self.device = _pool_region(pool, layout)
        self.agent = new_agent(nixl, name)
        self._reg = self.agent.register_memory(
            [(pool.data_ptr(), layout.nbytes, self.device, "")], self.mem
        )
        self._handle = msgspec.msgpack.encode(
            NixlPool(
                agent=name,
                metadata=self.agent.get_agent_metadata(),
                layout=layout.to_json(),
                base=pool.data_ptr(),
                mem=self.mem,
                device=self.device,
            )
        )
        self._progress = Progress(self.agent)

    def serve_reads(self, on: bool) -> None:
        """Progress the agent (reads can be served) or let it sleep (nothing pinned)."""
        self._progress.active(on)

    def handle(self) -> bytes:
        return self._handle

    def export(self, blocks: Sequence[int]) -> None:
        if self.pool.is_cuda:  # the READ may start as soon as the KVTransfer is out
            import torch

            torch.cuda.current_stream(self.pool.device).synchronize()

    def releases(self) -> list[KVRelease]:
        """Releases decode workers sent with their READs since the last call (collected
        while ``serve_reads`` is on)."""
        out = []
        while self._progress.releases:
            out.append(self._progress.releases.popleft())
        return out

    def close(self) -> None:
        if self._reg is not None:
            self._progress.stop()
            self.agent.deregister_memory(self._reg)
            self._reg = None


@dataclass
class _Source:
    agent: str
    layout: KVLayout
    descs: Any  # the prepared remote descriptor list, one per remote block
    handle: bytes


class NixlReceiver(KVReceiver):
    """Decode side: reads blocks of remote prefill pools into the local ``pool``.

    ``bytes_read`` and ``reads`` count what crossed this backend (tests and metrics).
    ``timeout_s`` bounds one READ: past it (a partitioned or dead peer) the fetch fails
    and the request is refused, never left hanging.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        layout: KVLayout,
        name: str,
        timeout_s: float = 30.0,
        nixl: ModuleType | None = None,
    ) -> None:
        nixl = nixl or load_nixl()
        self.pool, self.layout, self.timeout_s = pool, layout, timeout_s
        self.mem, self.device = _pool_region(pool, layout)
        self.agent = new_agent(nixl, name)
        self._reg = self.agent.register_memory(
            [(pool.data_ptr(), layout.nbytes, self.device, "")], self.mem
        )
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _block_descs(pool.data_ptr(), layout.num_blocks, layout.block_nbytes, self.device),
            self.mem,
        )
        self._errors = nixl_errors(nixl)
        self.sources: dict[int, _Source] = {}
        self.bytes_read = 0
        self.reads = 0

    def open(self, src_worker: int, handle: bytes) -> None:
        """Connect to prefill ``src_worker``'s pool, replacing an earlier one of it."""
        try:
            desc = msgspec.msgpack.decode(handle, type=NixlPool)
            layout = KVLayout.from_json(desc.layout)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            raise KVTransferError(f"prefill {src_worker}: unreadable nixl pool handle: {e}") from e
        check_compatible(self.layout, layout)
        self.drop(src_worker)
        try:
            name = self.agent.add_remote_agent(desc.metadata)
            name = name.decode() if isinstance(name, bytes) else name
            descs = self.agent.prep_xfer_dlist(
                name,
                _block_descs(desc.base, layout.num_blocks, layout.block_nbytes, desc.device),
                desc.mem,
            )
        except self._errors as e:
            raise KVTransferError(f"prefill {src_worker}: nixl cannot open its pool: {e}") from e
        self.sources[src_worker] = _Source(name, layout, descs, handle)

    def drop(self, src_worker: int) -> None:
        """Forget prefill ``src_worker``'s pool (no-op if it is not open)."""
        src = self.sources.pop(src_worker, None)
        if src is None:
            return
        self.agent.release_dlist_handle(src.descs)
        if all(s.agent != src.agent for s in self.sources.values()):
            self.agent.remove_remote_agent(src.agent)

    def start_fetch(
        self,
        src_worker: int,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        notify: bytes = b"",
    ) -> KVRead | None:
        """Post the READ of ``src_blocks`` into ``dst_blocks``; the read in flight, or None
        if it is already complete (nothing to move, or done at once)."""
        src = self.sources.get(src_worker)
        if src is None:
            raise KVTransferError(f"no nixl pool open for prefill worker {src_worker}")
        if len(src_blocks) != len(dst_blocks):
            raise KVTransferError(
                f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks"
            )
        check_ids(src_blocks, src.layout.num_blocks, "source")
        check_ids(dst_blocks, self.layout.num_blocks, "destination")
        try:
            if not src_blocks:
                if notify:
                    self.agent.send_notif(src.agent, notify)
                    self._flush_notif()
                return None
            xfer = self.agent.make_prepped_xfer(
                "READ", self._local, list(dst_blocks), src.descs, list(src_blocks), notify
            )
            read = _NixlRead(self, xfer, src_worker, len(src_blocks))
        except self._errors as e:  # the peer went away (host down, partition) or refused
            raise KVReadFailed(
                f"nixl READ from prefill {src_worker} failed: {type(e).__name__}: {e}"
            ) from e
        try:
            return None if read.poll() else read
        except KVReadFailed:  # failed at once: nothing is in flight, the handle goes
            read.abandon()
            raise

    def fetch(
        self,
        src_worker: int,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        notify: bytes = b"",
    ) -> None:
        read = self.start_fetch(src_worker, src_blocks, dst_blocks, notify)
        if read is None:
            return
        polls = 0
        try:
            while not read.poll():
                polls += 1
                if polls > _SPIN_POLLS:
                    time.sleep(_POLL_SLEEP_S)
        except KVReadFailed:
            while not read.abandon():  # the caller frees the blocks once this returns
                time.sleep(_POLL_SLEEP_S)
            raise

    def _flush_notif(self) -> None:
        """A notification with no READ has no completion to wait on: progress this agent
        a little (no progress thread runs here) so it leaves, connection set-up included."""
        deadline = time.monotonic() + _NOTIF_FLUSH_S
        polls = 0
        while polls < _NOTIF_FLUSH_POLLS or time.monotonic() < deadline:
            self.agent.get_new_notifs()
            polls += 1
            time.sleep(_POLL_SLEEP_S)

    def close(self) -> None:
        for worker in list(self.sources):
            self.drop(worker)
        if self._reg is not None:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._reg)
            self._reg = None


class _NixlRead(KVRead):
    """One posted READ. Each ``poll`` also progresses the receiver's agent (no progress
    thread runs on this side), so a caller that polls between decode steps moves it on."""

    def __init__(self, rx: NixlReceiver, xfer: Any, src_worker: int, blocks: int) -> None:
        self.rx, self.xfer, self.src_worker, self.blocks = rx, xfer, src_worker, blocks
        self.deadline = time.monotonic() + rx.timeout_s
        try:
            self.state = rx.agent.transfer(xfer)
        except BaseException:
            rx.agent.release_xfer_handle(xfer)
            raise

    def poll(self) -> bool:
        if self.xfer is None:
            return True
        self._check()
        if self.state == "DONE":
            self._release()
            self.rx.bytes_read += self.blocks * self.rx.layout.block_nbytes
            self.rx.reads += 1
            return True
        if self.state != "PROC":
            raise KVReadFailed(f"nixl READ from prefill {self.src_worker} failed ({self.state})")
        if time.monotonic() > self.deadline:
            raise KVReadFailed(
                f"nixl READ from prefill {self.src_worker} did not finish in {self.rx.timeout_s} s"
            )
        return False

    def _check(self) -> None:
        """Refresh ``state`` (each check also progresses the receiver's agent)."""
        if self.state != "PROC":
            return
        try:
            self.state = self.rx.agent.check_xfer_state(self.xfer)
        except self.rx._errors as e:
            self.state = f"ERR ({type(e).__name__}: {e})"

    def abandon(self) -> bool:
        if self.xfer is None:
            return True
        self._check()
        if self.state == "PROC":
            # NOTE: NIXL's release cannot recall a READ in flight (UCX does not cancel an
            # RMA get): freeing the blocks now would let it land in another request's KV.
            return False
        self._release()
        return True

    def _release(self) -> None:
        try:
            self.rx.agent.release_xfer_handle(self.xfer)
        except self.rx._errors as e:  # the read itself is over either way
            logger.warning(
                "nixl: releasing a READ handle of prefill %d failed: %s", self.src_worker, e
            )
        self.xfer = None


def release_notification(rid: int) -> bytes:
    """The ``notify`` bytes of a fetch that releases ``rid``'s blocks on the prefill side."""
    return encode(KVRelease(rid=rid, accepted=True))
