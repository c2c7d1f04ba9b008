"""The host's KV tiers beyond the pools: created here, shared by every engine worker.

Tier 2 is one shared-memory segment (``engine/kv/tiers/host_store.py``), a memfd: it never
has a name, so a killed server leaves nothing in /dev/shm, and it is not bound by
/dev/shm's size (often 64 MiB in containers), so its sparse pages can never SIGBUS when
/dev/shm fills; workers inherit the fd like every other segment's. Its pages are
committed as blocks arrive; its size is in the launcher's memory budget
(``launcher/memory.py``) all the same. Tier 3 is written only by this process's
``Persister`` thread, which the launcher stops, flushing what is pending, after every
worker has stopped. Neither names the blocks: the engine workers do, on their own pool's
layout (``engine/kv/tiers/keys.py``'s ``block_namespace``), and publish the namespace in
tier 2's header for the writer and the router.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.persister import Persister
from launcher.memory import GIB
from launcher.settings import ConfigError, ServerConfig
from transport.segment import Segment
from wire.kv_layout import KVLayout

logger = logging.getLogger(__name__)

# Tier 3 leaves this much of its file system free: 5 % of it, at most 1 GiB.
MIN_FREE_FRACTION, MIN_FREE_CAP = 0.05, GIB


def offload_bytes(config: ServerConfig) -> int:
    """Host memory tier 2 takes (0 when off): for the launcher's memory budget."""
    if not config.enable_prefix_caching:
        return 0
    return int(config.kv_offload_memory * GIB)


@dataclass
class HostTiers:
    segment: Segment
    store: HostStore
    persister: Persister | None

    def engine_fields(self) -> dict[str, object]:
        """What each engine worker's ``EngineConfig`` carries to attach the tiers."""
        d = self.persister.root if self.persister is not None else None
        return {
            "kv_offload_fd": self.segment.spec.fd,
            "kv_offload_nbytes": self.segment.spec.nbytes,
            "kv_offload_dir": None if d is None else str(d),
        }

    def frontend_fields(self) -> dict[str, object]:
        """What the frontend's router needs besides the segment to see the tiers' content
        (``router/tier_residency.py``): tier 3's dir (the namespace is in the segment)."""
        d = self.persister.root if self.persister is not None else None
        return {"dir": None if d is None else str(d)}

    def stop(self) -> None:
        """Flush what tier 3 has not written yet (the workers are stopped by now)."""
        if self.persister is not None:
            self.persister.stop(flush=True)
            logger.info(
                "KV tier 3 flushed: %d files, %.1f MiB",
                len(self.persister.files),
                self.persister.usage / (1 << 20),
            )


def create(config: ServerConfig, layout: KVLayout) -> HostTiers | None:
    """The host's tiers for ``config``, or None when they are off."""
    nbytes = offload_bytes(config)
    if nbytes <= 0:
        return None
    geometry = Geometry.for_budget(nbytes, layout.block_size, layout.block_nbytes)
    fd, _ = create_segment(geometry.offsets[3])
    segment = Segment.attach_fd(fd, geometry.offsets[3], "kvtier")
    HostStore.format(segment.buf, geometry)
    store = HostStore(segment.spec.fd, segment.buf)
    persister = None
    if config.kv_offload_dir is not None:
        root = config.kv_offload_dir
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--kv-offload-dir {root}: not a writable directory ({e})") from e
        st = os.statvfs(root)
        min_free = min(MIN_FREE_CAP, int(st.f_blocks * st.f_frsize * MIN_FREE_FRACTION))
        persister = Persister(store, root, int(config.kv_offload_disk * GIB), min_free)
        persister.start()
    logger.info(
        "KV tier 2: %.2f GiB of host RAM, %d blocks, shared by every worker%s",
        nbytes / GIB,
        geometry.slots,
        ""
        if persister is None
        else f"; tier 3: {config.kv_offload_dir}, {config.kv_offload_disk:g} GiB",
    )
    return HostTiers(segment, store, persister)
