"""Which KV blocks are free, in use by a running sequence, or pinned for a transfer.

Every block is in exactly one of three states, so ``free + used + pinned == total``
always holds. A prefill worker pins a finished request's blocks while a decode worker
copies them, then unpins and frees them in one step.
"""

from __future__ import annotations

import enum
from collections import deque

from engine.errors import NoFreeBlocks


class BlockState(enum.Enum):
    FREE = 0
    USED = 1
    PINNED = 2


class BlockAllocator:
    """Hands out block ids of a pool of ``num_blocks``; no ref counts, no prefix sharing."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._state = [BlockState.FREE] * num_blocks
        self._used: set[int] = set()
        self._pinned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def allocate(self, n: int) -> list[int]:
        """Move ``n`` free blocks to USED; raises ``NoFreeBlocks`` leaving state unchanged."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocks(n, len(self._free))
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._state[i] = BlockState.USED
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """USED -> FREE. Freeing a block that is not USED is a caller bug."""
        self._move(ids, BlockState.USED, BlockState.FREE)

    def pin(self, ids: list[int]) -> None:
        """USED -> PINNED: the blocks are being copied out and must not be reused."""
        self._move(ids, BlockState.USED, BlockState.PINNED)

    def unpin_and_free(self, ids: list[int]) -> None:
        """PINNED -> FREE, once the receiver has its copy (or gave up)."""
        self._move(ids, BlockState.PINNED, BlockState.FREE)

    def state(self, block_id: int) -> BlockState:
        return self._state[block_id]

    def _move(self, ids: list[int], src: BlockState, dst: BlockState) -> None:
        # Validate everything first so a bad id leaves the allocator untouched.
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in {ids}")
        bad = [i for i in ids if not 0 <= i < self.num_blocks or self._state[i] is not src]
        if bad:
            raise ValueError(f"blocks {bad} are not {src.name}")
        sets = {BlockState.USED: self._used, BlockState.PINNED: self._pinned}
        for i in ids:
            self._state[i] = dst
            if src in sets:
                sets[src].discard(i)
            if dst in sets:
                sets[dst].add(i)
            else:
                self._free.append(i)

    def check_invariants(self) -> None:
        assert len(self._free) + len(self._used) + len(self._pinned) == self.num_blocks
        assert len(set(self._free)) == len(self._free)
        assert all(self._state[i] is BlockState.FREE for i in self._free)
        assert all(self._state[i] is BlockState.USED for i in self._used)
        assert all(self._state[i] is BlockState.PINNED for i in self._pinned)
