"""What the host's KV tiers (tier 2 in host RAM, tier 3 on disk) hold of a prompt, for
the cache-aware router.

A worker's prefix summary (``transport/prefix_summary.py``) covers its own pool only. The
tiers beyond the pools are shared by every engine worker of a host
(``engine/kv/tiers/``): a prefix there is a hit for each of them, after the blocks its
pool holds. So the router asks the tiers once per request, through this view, and adds
their run to every candidate on the tiers' node.

Who does what:
    launcher   gives the frontend the host's tier-2 segment and tier 3's directory
               (``ProcessSpec.segments["kvtier"]``); the blocks' namespace is in the
               segment's header, where the engine workers published it.
    router     ``TierResidency.query(token_ids, block_size)`` once per request, then
               ``TierQuery.run(first)`` per candidate: the blocks from ``first`` on that a
               worker whose pool holds ``first`` leading blocks would load from the tiers.

``run`` mirrors ``engine.kv.tiers.tiered.TieredKV.load``: the longest run of tier-2 hits
from ``first``, continued by tier 3 from where tier 2 stopped. Tier 2 is read under its
lock (one lock per query position, no copy); tier 3 is one ``stat`` per block, walked
until the first missing file. Results are memoised per request, so candidates with the
same pool prefix cost one walk. Like the summaries, it is a guess: a block evicted
between placement and prefill is recomputed, never wrongly reused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import HostStore
from engine.kv.tiers.keys import chain_keys, root_key


class TierResidency:
    """The host tiers of node ``node``: ``host`` (tier 2), tier 3 under ``disk_dir``."""

    def __init__(self, host: HostStore, disk_dir: Path | None, node: str = "") -> None:
        self.host, self.node, self.disk_dir = host, node, disk_dir
        self.namespace: bytes | None = None  # the workers', once one has published it
        self.disk: DiskStore | None = None

    def query(
        self, token_ids: Sequence[int], block_size: int, extra: bytes | None = None
    ) -> TierQuery | None:
        """What the tiers hold of ``token_ids``' full blocks, keys salted by ``extra`` as
        the workers' are (a LoRA adapter's); None for another block size (a tier of
        another geometry cannot be the workers') or before a worker named the blocks."""
        if block_size != self.host.geometry.block_size or not self._named():
            return None
        return TierQuery(self, token_ids, extra)

    def _named(self) -> bool:
        """Whether the workers' namespace is known (read from tier 2's header once)."""
        if self.namespace is None:
            self.namespace = self.host.namespace
            if self.namespace is not None and self.disk_dir is not None:
                g = self.host.geometry  # reads only ``path``: any payload size would do
                self.disk = DiskStore(self.disk_dir, self.namespace, g.block_size, g.payload_nbytes)
        return self.namespace is not None


class TierQuery:
    """One request's view of the tiers, walked lazily and memoised."""

    def __init__(
        self, tiers: TierResidency, token_ids: Sequence[int], extra: bytes | None = None
    ) -> None:
        self._tiers = tiers
        self._token_ids = token_ids
        self._extra = extra
        self._keys: list[bytes] | None = None
        self._runs: dict[int, int] = {}

    def keys(self) -> list[bytes]:
        if self._keys is None:
            t = self._tiers
            assert t.namespace is not None, "queries exist only once the blocks are named"
            parent = root_key(t.namespace, self._extra)
            self._keys = chain_keys(parent, self._token_ids, t.host.geometry.block_size)
        return self._keys

    def run(self, first: int) -> int:
        """Blocks from ``first`` on that a worker holding ``first`` leading blocks would
        load from the tiers: tier 2's run from ``first``, then tier 3's from its end."""
        got = self._runs.get(first)
        if got is None:
            keys = self.keys()[first:]
            got = self._tiers.host.held_run(keys)
            disk = self._tiers.disk
            while disk is not None and got < len(keys) and os.path.exists(disk.path(keys[got])):
                got += 1
            self._runs[first] = got
        return got
