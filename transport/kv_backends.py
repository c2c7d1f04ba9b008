"""The two KV handoff backends: ``shm`` (CPU, and the GPU fallback) and ``cuda_ipc``.

shm: the source of every copy is a CPU tensor over a shared segment that each decode
    worker maps: the prefill pool itself on CPU, or, when the prefill pool is on a GPU, a
    staging mirror of it (same layout, same block ids) that ``export`` fills with one
    device-to-host copy per block run. On GPU the mirror is registered with CUDA
    (cudaHostRegister) in both processes, so both hops are DMA, not pageable copies.
cuda_ipc: the decode worker opens the prefill GPU pool once from its CUDA IPC handle
    (sent as plain bytes, never pickled) and copies block runs device to device.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence

import msgspec
import torch

from transport import _atomics
from transport.errors import KVTransferError
from transport.kv import KVExporter, KVReceiver, block_runs, check_ids


def register_host_memory(tensor: torch.Tensor) -> None:
    """Page-lock a shared CPU tensor for CUDA DMA (in each process that maps it)."""
    if not torch.cuda.is_available() or tensor.is_cuda:
        return
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise KVTransferError(f"cudaHostRegister of {nbytes} bytes failed with error {err}")


def _copy_runs(
    dst: torch.Tensor, src: torch.Tensor, src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    check_ids(src_blocks, src.shape[0], "source")
    check_ids(dst_blocks, dst.shape[0], "destination")
    if not (dst.is_cuda or src.is_cuda):
        assert dst.is_contiguous() and src.is_contiguous()
        runs = array.array("q", [x for run in block_runs(src_blocks, dst_blocks) for x in run])
        block_nbytes = src[0].numel() * src.element_size()
        _atomics.copy_runs(dst.data_ptr(), src.data_ptr(), block_nbytes, runs.tobytes())
        return
    async_ok = dst.is_cuda or src.is_cuda  # host side is pinned: DMA, synchronised below
    for s, d, n in block_runs(src_blocks, dst_blocks):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=async_ok)
    if async_ok:
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()


class ShmExporter(KVExporter):
    """Prefill side of ``shm``. ``staging`` is None when ``pool`` itself is shared (CPU)."""

    def __init__(self, pool: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        if pool.is_cuda and staging is None:
            raise KVTransferError("a GPU pool needs a shared staging mirror for the shm backend")
        if staging is not None and staging.shape != pool.shape:
            raise KVTransferError(f"staging {tuple(staging.shape)} != pool {tuple(pool.shape)}")
        self.pool, self.staging = pool, staging

    def export(self, blocks: Sequence[int]) -> None:
        if self.staging is None:
            return  # decode reads the shared pool directly; prefill wrote it synchronously
        _copy_runs(self.staging, self.pool, blocks, blocks)


class ShmReceiver(KVReceiver):
    """Decode side of ``shm``: ``sources[i]`` is prefill i's shared pool or staging mirror."""

    def __init__(self, sources: Mapping[int, torch.Tensor], pool: torch.Tensor) -> None:
        for i, src in sources.items():
            if src.is_cuda or src.shape[1:] != pool.shape[1:] or src.dtype != pool.dtype:
                raise KVTransferError(f"prefill {i}'s shared pool does not match the local pool")
        self.sources, self.pool = dict(sources), pool

    def fetch(self, src_worker: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        src = self.sources.get(src_worker)
        if src is None:
            raise KVTransferError(f"no shared pool for prefill worker {src_worker}")
        _copy_runs(self.pool, src, src_blocks, dst_blocks)


class _CudaHandle(msgspec.Struct, array_like=True, frozen=True):
    """torch's CUDA IPC description of one storage (``UntypedStorage._share_cuda_``)."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    shape: list[int]
    dtype: str


class CudaIpcExporter(KVExporter):
    """Prefill side of ``cuda_ipc``: the pool stays where it is; decode maps it."""

    def __init__(self, pool: torch.Tensor) -> None:
        if not pool.is_cuda or pool.storage_offset() != 0 or not pool.is_contiguous():
            raise KVTransferError("cuda_ipc needs a contiguous CUDA pool at offset 0")
        self.pool = pool

    def handle(self) -> bytes:
        dev, handle, size, offset, rc_handle, rc_offset, event, sync = (
            self.pool.untyped_storage()._share_cuda_()
        )
        desc = _CudaHandle(
            device=dev,
            handle=handle,
            size_bytes=size,
            offset_bytes=offset,
            ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset,
            event_handle=event,
            event_sync_required=sync,
            shape=list(self.pool.shape),
            dtype=str(self.pool.dtype).removeprefix("torch."),
        )
        return msgspec.msgpack.encode(desc)

    def export(self, blocks: Sequence[int]) -> None:
        # KV writes run on prefill's stream; decode's copy must not start before they end.
        torch.cuda.current_stream(self.pool.device).synchronize()


def open_cuda_pool(handle: bytes, device: torch.device | None = None) -> torch.Tensor:
    """Map a prefill pool from its ``CudaIpcExporter.handle()`` bytes (once per worker).

    ``device``: this process's GPU, the one the mapping is opened from and its copies run
    on (default: the handle's device index, for processes that number GPUs alike). Each
    worker sees only its own GPU (CUDA_VISIBLE_DEVICES), so the prefill's device index
    means nothing here; CUDA opens IPC handles of GPUs the caller cannot see, reading them
    over peer access.
    NOTE: the handle's event is not waited on: the prefill synchronises its stream in
    ``export`` before every KVTransfer, and nothing is read from the pool before one.
    """
    h = msgspec.msgpack.decode(handle, type=_CudaHandle)
    torch.cuda._lazy_init()
    index = h.device if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        h.handle,
        h.size_bytes,
        h.offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        False,
    )
    strides: list[int] = []
    step = 1
    for dim in reversed(h.shape):  # contiguous strides of the prefill pool
        strides.insert(0, step)
        step *= dim
    out = torch.empty(0, dtype=getattr(torch, h.dtype), device=f"cuda:{index}")
    return out.set_(storage, 0, h.shape, strides)


class CudaIpcReceiver(KVReceiver):
    """Decode side of ``cuda_ipc``: ``sources[i]`` is prefill i's mapped GPU pool.

    Pools arrive one by one (``open``, on each ``KVPoolHandle``) and go when their prefill
    process does (``drop``): a dead process's pool memory is no longer valid to read.
    """

    def __init__(self, sources: Mapping[int, torch.Tensor], pool: torch.Tensor) -> None:
        self.sources, self.pool = dict(sources), pool

    def open(self, src_worker: int, handle: bytes) -> None:
        """Map prefill ``src_worker``'s pool, replacing an earlier mapping of it."""
        self.sources.pop(src_worker, None)
        src = open_cuda_pool(handle, self.pool.device)
        if src.shape[1:] != self.pool.shape[1:] or src.dtype != self.pool.dtype:
            raise KVTransferError(
                f"prefill {src_worker}'s pool {tuple(src.shape)} {src.dtype} does not match "
                f"the local pool {tuple(self.pool.shape)} {self.pool.dtype}"
            )
        self.sources[src_worker] = src

    def drop(self, src_worker: int) -> None:
        """Unmap prefill ``src_worker``'s pool (no-op if it is not mapped)."""
        self.sources.pop(src_worker, None)

    def fetch(self, src_worker: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        src = self.sources.get(src_worker)
        if src is None:
            raise KVTransferError(f"no mapped pool for prefill worker {src_worker}")
        _copy_runs(self.pool, src, src_blocks, dst_blocks)
