"""Opening a pool's tiers: the host's tier-2 segment (inherited fd), tier 3's directory,
and the class that fits the pool's device (``TieredKV`` on CPU, ``AsyncTieredKV`` with a
side-stream copier on CUDA)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kv.tiers.async_tiers import AsyncTieredKV
from engine.kv.tiers.cuda_copy import CudaCopier
from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import HostStore
from engine.kv.tiers.keys import Namespace, weights_fingerprint
from engine.kv.tiers.tiered import TieredKV

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module does not name it
_MAP_CHUNK = 64 << 20


def map_pages(mapping: mmap.mmap) -> None:
    """Fault every page of tier 2's mapping into this process, on a low-priority thread.

    NOTE: left to fault in on first write, a slot's pages cost a store (a tier-3 hit
    promoted to tier 2, a block offered) about 90 page faults a 360 KiB block, several
    times the memcpy (measured: 665 us against 97 us per store; a cold tier-3 load of
    256 blocks ran at 0.19-0.26 GB/s into a fresh segment, 0.46-0.89 GB/s into a mapped
    one, load 12). The content is not touched; another worker may be writing it.
    """
    with contextlib.suppress(OSError):  # per-thread niceness: Linux
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    try:
        for start in range(0, len(mapping), _MAP_CHUNK):
            mapping.madvise(_MADV_POPULATE_WRITE, start, min(_MAP_CHUNK, len(mapping) - start))
    except (OSError, ValueError) as e:  # an older kernel, or the mapping closed meanwhile
        logger.debug("KV tier 2: pages not mapped ahead (%s); they fault in on first use", e)


def open_tiers(config: EngineConfig, pool: torch.Tensor) -> TieredKV | None:
    """The tiers ``config`` names for this pool (``kv_offload_fd``: the host's tier-2
    segment, inherited; ``kv_offload_dir``: tier 3), or None when they are off."""
    if config.kv_offload_fd is None or not config.enable_prefix_caching:
        return None
    mapping = mmap.mmap(config.kv_offload_fd, config.kv_offload_nbytes, mmap.MAP_SHARED)
    host = HostStore(config.kv_offload_fd, memoryview(mapping))
    threading.Thread(target=map_pages, args=(mapping,), name="kv-tier-map", daemon=True).start()
    ns = Namespace(
        weights=weights_fingerprint(Path(config.model)),
        dtype=str(pool.dtype),
        block_size=config.block_size,
        layout=str(tuple(pool.shape[1:])),
    ).digest
    disk = None
    if config.kv_offload_dir:
        nbytes = pool[0].numel() * pool.element_size()
        disk = DiskStore(Path(config.kv_offload_dir), ns, config.block_size, nbytes)
    logger.info(
        "KV tiers: host RAM (%d blocks shared by this host's workers)%s",
        host.geometry.slots,
        f", disk at {config.kv_offload_dir}" if disk else "",
    )
    if pool.is_cuda:
        return AsyncTieredKV(host, disk, ns, pool, CudaCopier(pool, host.payload))
    return TieredKV(host, disk, ns, pool)
