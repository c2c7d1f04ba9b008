"""Which detokenizer shard owns a request: fixed at admission, from the request id alone.

Hashing the id (not the HTTP worker or the arrival order) spreads load evenly over the
K shards whatever the number of frontends, and any process can recompute the owner.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence


def shard_for(rid: int, k: int) -> int:
    """crc32 of the id's 8 little-endian bytes, modulo ``k``."""
    if k <= 0:
        raise ValueError(f"number of detokenizer shards must be >= 1, got {k}")
    return zlib.crc32(rid.to_bytes(8, "little", signed=False)) % k


def live_shard_for(rid: int, alive: Sequence[bool]) -> int | None:
    """``shard_for`` among the live shards: the owner if it is alive, else the next live
    one after it (cyclically); None when none is. A request keeps the shard it was given:
    this is consulted only when one is assigned, at admission or on a resume."""
    k = len(alive)
    first = shard_for(rid, k)
    for step in range(k):
        shard = (first + step) % k
        if alive[shard]:
            return shard
    return None
