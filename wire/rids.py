"""Request ids name the frontend that owns them.

A rid is a non-negative int64 (it travels in msgspec records and in ``TokenBatch``'s int64
column):

    bits 56-62   the owning frontend, 0 .. MAX_FRONTENDS - 1: where its text must go
    bits 0-55    that frontend's counter

Any process recovers the owner from the rid alone (``owner_of``), so a detokenizer shard
routes each request's text to its owner's ring with no table to keep in step. A
frontend's counter starts at a random point below 2**40: a restarted frontend's rids then
do not collide with records of its predecessor's requests still in worker rings.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator

OWNER_SHIFT = 56
MAX_FRONTENDS = 1 << (63 - OWNER_SHIFT)  # 128
_START_BITS = 40


def owner_of(rid: int) -> int:
    """The index of the frontend that owns ``rid``."""
    return rid >> OWNER_SHIFT


def owned_rids(owner: int, start: int | None = None) -> Iterator[int]:
    """Fresh rids of frontend ``owner``, from ``start`` (default: random) upwards."""
    if not 0 <= owner < MAX_FRONTENDS:
        raise ValueError(f"frontend index must be in [0, {MAX_FRONTENDS}), got {owner}")
    first = secrets.randbits(_START_BITS) if start is None else start
    base = owner << OWNER_SHIFT
    # NOTE: 2**56 - 2**40 ids before the counter could reach the owner bits: never.
    return (base | n for n in itertools.count(first))
