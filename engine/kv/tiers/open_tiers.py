"""Opening a pool's tiers: the host's tier-2 segment (inherited fd), tier 3's directory,
and the class that fits the pool's device (``TieredKV`` on CPU, ``AsyncTieredKV`` with a
side-stream copier on CUDA). The workers name the blocks: the first to open the tiers
publishes their namespace in tier 2's header, where tier 3's writer and the router read it."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kv.kv_cache import layout_of
from engine.kv.tiers.async_tiers import AsyncTieredKV
from engine.kv.tiers.cuda_copy import CudaCopier
from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import HostStore
from engine.kv.tiers.keys import block_namespace, weights_fingerprint
from engine.kv.tiers.tiered import TieredKV

logger = logging.getLogger(__name__)


def open_tiers(config: EngineConfig, pool: torch.Tensor, order: str = "tokens") -> TieredKV | None:
    """The tiers ``config`` names for this pool (``kv_offload_fd``: the host's tier-2
    segment, inherited; ``kv_offload_dir``: tier 3), or None when they are off. ``order``:
    the block byte order of the pool's attention backend (``KVLayout.order``)."""
    if config.kv_offload_fd is None or not config.enable_prefix_caching:
        return None
    buf = memoryview(mmap.mmap(config.kv_offload_fd, config.kv_offload_nbytes, mmap.MAP_SHARED))
    host = HostStore(config.kv_offload_fd, buf)
    ns = block_namespace(weights_fingerprint(Path(config.model)), layout_of(pool, order))
    adopted = host.adopt_namespace(ns)
    if adopted != ns:  # another worker of this host writes blocks of another layout
        logger.error(
            "KV tiers off in this worker: its blocks (%s order, %s) are not those the "
            "host's tiers hold (namespace %s, this worker's %s)",
            order,
            pool.dtype,
            adopted.hex(),
            ns.hex(),
        )
        return None
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
