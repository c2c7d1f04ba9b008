"""Which detokenizer shard owns a request: fixed at admission, from the request id alone.

Hashing the id (not the HTTP worker or the arrival order) spreads load evenly over the
K shards whatever the number of frontends, and any process can recompute the owner.
"""

from __future__ import annotations

import zlib


def shard_for(rid: int, k: int) -> int:
    """crc32 of the id's 8 little-endian bytes, modulo ``k``."""
    if k <= 0:
        raise ValueError(f"number of detokenizer shards must be >= 1, got {k}")
    return zlib.crc32(rid.to_bytes(8, "little", signed=False)) % k
