"""KV blocks: free, cached for prefix reuse, in use by sequences, or pinned for a transfer.

A block's *hash* names its contents: the hash of its parent block (the previous block of
the same sequence) and its ``block_size`` token ids, so equal hashes mean equal token
prefixes and therefore equal KV. ``block_hashes`` computes them; it is stable across
processes and runs (blake2b, not Python's salted ``hash()``), so a frontend or router can
compute the same values to ask a worker what it holds.

Every block is in exactly one state, so ``free + cached + used + pinned == total``:
    FREE    no references, no hash: contents are garbage
    CACHED  no references, hashed: contents are a reusable prefix block, evictable (LRU)
    USED    referenced by one or more sequences, none of them a transfer
    PINNED  at least one reference is a transfer's (decode is copying it out)
NOTE: a referenced (USED or PINNED) block is never evicted, and a hashed block is full
and never written again; only FREE blocks and evicted CACHED blocks are handed out.

Who calls what, when (``engine.runner.ModelRunner`` is the usual caller):
- ``allocate(n)`` -> n private blocks (ref 1, unhashed) for positions a sequence is about
  to compute; it evicts least-recently-used CACHED blocks when FREE ones run out. FREE
  blocks go out the last freed first, then the never used in order: a freed block's
  pages are resident already (a CPU pool commits a page when it is first written), so
  reusing it faults nothing in, and the pool's resident part grows only with what is
  held at once or cached.
- ``acquire(hashes)`` -> the blocks holding the longest cached prefix of ``hashes``, one
  reference taken on each (CACHED -> USED). Done once, before a sequence's first forward.
- ``register(block, hash)`` once a block's last slot is computed: from now on a sequence
  whose prefix has that hash may ``acquire`` it. If another block already holds the hash
  this one stays private (the first copy wins; the duplicate is freed as FREE later).
- ``share(blocks)`` takes one more sequence reference on blocks already in use: a
  sequence forked from the one holding them (the choices of an ``n > 1`` request).
- ``free(blocks)`` drops one reference per id; a block losing its last one becomes CACHED
  if hashed (its chain's tail is evicted first), else FREE.
- ``pin(blocks)`` turns a sequence's reference into a transfer's (the prefill worker hands
  a finished request's blocks to decode); ``unpin(blocks)`` drops that reference once
  decode has its copy, or gave up, or died.
- ``lookup(hashes)`` counts the leading hashes held, changing nothing (for planners and
  load reports).
- ``watch_hashes()`` once, then ``take_hash_changes()`` every step: the hashes that became
  held (registered) and stopped being held (evicted) since the last call, for a worker
  that publishes a summary of what it holds (``transport/prefix_summary.py``). Counts: ``num_free/num_cached/num_used/num_pinned``, ``num_available``
  (what ``allocate`` can hand out), ``num_hashed``; ``stats`` holds prefix-hit counters.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import NoFreeBlocks

# Versioned: a change to how hashes are computed must not match hashes of the old scheme.
_PERSON_ROOT = b"pdserve-root-v1"
_PERSON_BLOCK = b"pdserve-block-v1"


def root_hash(extra: bytes | None = None) -> int:
    """The parent hash of a sequence's first block; ``extra`` (e.g. an adapter id) salts it."""
    digest = hashlib.blake2b(extra or b"", digest_size=8, person=_PERSON_ROOT).digest()
    return int.from_bytes(digest, "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes | None = None,
    *,
    parent: int | None = None,
) -> list[int]:
    """64-bit chained hashes of every *full* block of ``token_ids`` (a tail is not hashed).

    Block i's hash covers block i-1's hash and its own token ids, so it names the whole
    prefix up to its end. ``parent`` continues a chain (the hash of the block before
    ``token_ids[0]``); without it the chain starts at ``root_hash(extra)``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    # uint32 little-endian: the same bytes on every host for every token id of a vocab.
    raw = memoryview(np.asarray(token_ids[: n * block_size], dtype="<u4").tobytes())
    h = root_hash(extra) if parent is None else parent
    step = 4 * block_size
    out = []
    for i in range(n):
        b = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8, person=_PERSON_BLOCK)
        b.update(raw[i * step : (i + 1) * step])
        h = int.from_bytes(b.digest(), "little")
        out.append(h)
    return out


class BlockState(enum.Enum):
    FREE = 0
    CACHED = 1
    USED = 2
    PINNED = 3


@dataclass
class PrefixStats:
    """Prefix-cache counters since start, recorded by ``KVPool.reuse_prefix`` (and by
    a decode worker's KV imports: tokens handed off, and those it already held)."""

    queried_tokens: int = 0  # tokens of sequences looked up (once each per computation)
    hit_tokens: int = 0  # of those, tokens whose KV was reused

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class KVFigures:
    """A pool's figures at one moment, as a worker's load-table row carries them."""

    free_blocks: int  # free plus evictable cached: what allocation can have now
    total_blocks: int
    hashed_blocks: int  # blocks a prefix lookup can hit
    hit_tokens: int
    queried_tokens: int


class BlockAllocator:
    """Ref-counted blocks of a pool of ``num_blocks`` with a hash -> block prefix table."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._refs = [0] * num_blocks  # every reference, a transfer's pins included
        self._pins = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._num_pinned = 0  # blocks with pins > 0
        self.stats = PrefixStats()
        # (registered, evicted) hashes since the last take_hash_changes(); None: unwatched,
        # so an allocator nobody publishes keeps no journal that would grow forever.
        self._journal: tuple[list[int], list[int]] | None = None

    # ---- counts --------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Hashed blocks nobody references: reusable until evicted."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached) - self._num_pinned

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_hashed(self) -> int:
        """Blocks a prefix lookup can hit (cached, or in use and shareable)."""
        return len(self._by_hash)

    def figures(self) -> KVFigures:
        return KVFigures(
            self.num_available,
            self.num_blocks,
            self.num_hashed,
            self.stats.hit_tokens,
            self.stats.queried_tokens,
        )

    def state(self, block_id: int) -> BlockState:
        if self._pins[block_id]:
            return BlockState.PINNED
        if self._refs[block_id]:
            return BlockState.USED
        return BlockState.FREE if self._hash[block_id] is None else BlockState.CACHED

    def writable(self, block_id: int) -> bool:
        """May a sequence write KV here: its only reference is the writer's, and unhashed."""
        return (
            self._refs[block_id] == 1
            and not self._pins[block_id]
            and (self._hash[block_id] is None)
        )

    # ---- verbs ---------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` private blocks (ref 1); raises ``NoFreeBlocks`` leaving state unchanged."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available:
            raise NoFreeBlocks(n, self.num_available)
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently used cached block
                b, _ = self._cached.popitem(last=False)
                h = self._hash[b]
                assert h is not None
                del self._by_hash[h]
                self._hash[b] = None
                if self._journal is not None:
                    self._journal[1].append(h)
            self._refs[b] = 1
            ids.append(b)
        return ids

    def lookup(self, hashes: Iterable[int]) -> int:
        """How many leading ``hashes`` have a block here; changes nothing."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[int]) -> list[int]:
        """A reference on each block of the longest held prefix of ``hashes``; their ids."""
        ids = [self._by_hash[h] for h in hashes[: self.lookup(hashes)]]
        for b in ids:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1
        return ids

    def register(self, block_id: int, block_hash: int) -> bool:
        """Publish a just-filled private block under ``block_hash``; False if a copy exists.

        NOTE: the caller promises every slot is computed and will never be written again.
        """
        assert self._refs[block_id] > 0, f"block {block_id} is not in use"
        if self._hash[block_id] == block_hash:
            return True
        assert self._hash[block_id] is None, f"block {block_id} already has another hash"
        if block_hash in self._by_hash:
            return False
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        if self._journal is not None:
            self._journal[0].append(block_hash)
        return True

    def watch_hashes(self) -> None:
        """Start journaling hash changes; the journal starts with every hash held now."""
        self._journal = (list(self._by_hash), [])

    def take_hash_changes(self) -> tuple[list[int], list[int]]:
        """(registered, evicted) hashes since the last call; a hash may be in both.

        NOTE: applying every registration before every eviction never counts a hash
        below zero, whatever order they happened in.
        """
        assert self._journal is not None, "watch_hashes() first"
        out, self._journal = self._journal, ([], [])
        return out

    def forget_hashes(self) -> int:
        """Unhash every block (a prefix-cache reset): CACHED blocks become FREE, referenced
        ones stay with their sequences but no lookup finds them any more. Journaled as
        evictions; returns the hashes dropped."""
        dropped = list(self._by_hash)
        self._free.extendleft(reversed(self._cached))  # resident pages first, as in _release
        self._cached.clear()
        for b in self._by_hash.values():
            self._hash[b] = None
        self._by_hash.clear()
        if self._journal is not None:
            self._journal[1].extend(dropped)
        return len(dropped)

    def share(self, ids: Sequence[int]) -> None:
        """One more sequence reference on each of ``ids``, which must be in use already.

        NOTE: a shared block is written by nobody: it is full, or the tail of a prompt
        whose sharers all write their next tokens elsewhere (their own copy of it).
        """
        self._check(ids, lambda b, k: self._refs[b] > 0, "in use")
        for b in ids:
            self._refs[b] += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drop one sequence reference per id (all or nothing: a bad id raises first)."""
        self._check(ids, lambda b, k: self._refs[b] - self._pins[b] >= k, "held by a sequence")
        self._release(ids)

    def pin(self, ids: Sequence[int]) -> None:
        """Turn one sequence reference per id into a transfer's pin."""
        self._check(ids, lambda b, k: self._refs[b] - self._pins[b] >= k, "held by a sequence")
        for b in ids:
            self._num_pinned += self._pins[b] == 0
            self._pins[b] += 1

    def unpin(self, ids: Sequence[int]) -> None:
        """Drop one transfer pin (and its reference) per id: decode is done with them."""
        self._check(ids, lambda b, k: self._pins[b] >= k, "pinned")
        for b in ids:
            self._pins[b] -= 1
            self._num_pinned -= self._pins[b] == 0
        self._release(ids)

    def _release(self, ids: Sequence[int]) -> None:
        # Reversed: a chain's tail becomes least recently used, so it is evicted before
        # the blocks it depends on (a tail without its head can never be hit).
        for b in reversed(ids):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if self._hash[b] is None:
                self._free.appendleft(b)  # reused first: its pages are resident and warm
            else:
                self._cached[b] = None

    def _check(self, ids: Sequence[int], ok: Callable[[int, int], bool], what: str) -> None:
        # Validate everything first so a bad id leaves the allocator untouched; an id may
        # repeat (two transfers pinning one shared block), each repeat needing a reference.
        counts = Counter(ids)
        bad = [b for b, k in counts.items() if not 0 <= b < self.num_blocks or not ok(b, k)]
        if bad:
            raise ValueError(f"blocks {bad} are not {what}")

    def check_invariants(self) -> None:
        states = Counter(self.state(b) for b in range(self.num_blocks))
        assert states[BlockState.FREE] == len(self._free) == len(set(self._free))
        assert states[BlockState.CACHED] == len(self._cached)
        assert states[BlockState.PINNED] == self._num_pinned
        assert states[BlockState.USED] == self.num_used
        assert sum(states.values()) == self.num_blocks
        assert all(self.state(b) is BlockState.FREE for b in self._free)
        assert all(self.state(b) is BlockState.CACHED for b in self._cached)
        assert all(self._pins[b] <= self._refs[b] for b in range(self.num_blocks))
        assert all(self._hash[b] == h for h, b in self._by_hash.items())
        assert sum(h is not None for h in self._hash) == len(self._by_hash)
