"""The block allocator never loses, duplicates or double-hands-out a block; prefix hashes
are stable; a cached block is reused while held and evicted only when nobody holds it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import NoFreeBlocks
from engine.kv.block_allocator import BlockAllocator, BlockState, block_hashes, root_hash

VERBS = ["alloc", "grow", "register", "finish", "acquire", "free", "pin", "unpin", "unpin_all"]
# An operation: (verb, a, b). a/b pick sizes, holders, blocks or hashes (taken modulo).
OPS = st.lists(
    st.tuples(st.sampled_from(VERBS), st.integers(0, 12), st.integers(0, 12)), max_size=80
)
HASHES = 8  # few distinct hashes, so registrations collide and acquisitions hit


class Model:
    """What the allocator must do, written the obvious way: per-block counts, free blocks
    the last freed first and then the never used in order, an LRU of cached ones, and
    what each block's KV currently holds."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.refs, self.pins = [0] * n, [0] * n
        self.hash: list[int | None] = [None] * n
        self.free: deque[int] = deque(range(n))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.content: list[int | None] = [None] * n  # the hash whose KV the block holds

    def state(self, b: int) -> BlockState:
        if self.pins[b]:
            return BlockState.PINNED
        if self.refs[b]:
            return BlockState.USED
        return BlockState.FREE if self.hash[b] is None else BlockState.CACHED

    def allocate(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.lru.popitem(last=False)
                self.hash[b] = None
            assert self.refs[b] == 0  # never a referenced block
            self.refs[b], self.content[b] = 1, None  # the new holder overwrites it
            out.append(b)
        return out

    def by_hash(self, h: int) -> int | None:
        return next((b for b in range(self.n) if self.hash[b] == h), None)

    def release(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.hash[b] is None:
                    self.free.appendleft(b)
                else:
                    self.lru[b] = None


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=OPS)
def test_random_operations_match_the_model_and_keep_the_invariants(
    num_blocks: int, ops: list[tuple[str, int, int]]
) -> None:
    alloc, model = BlockAllocator(num_blocks), Model(num_blocks)
    held: list[list[int]] = []  # per sequence: its block table
    pinned: list[list[int]] = []  # per transfer: its blocks
    for verb, a, b in ops:
        if verb in ("alloc", "grow"):
            before = alloc.num_available
            try:
                ids = alloc.allocate(a)
            except NoFreeBlocks:
                assert a > before == len(model.free) + len(model.lru)
                continue
            assert ids == model.allocate(a)
            if verb == "grow" and held:
                held[b % len(held)].extend(ids)
            else:
                held.append(ids)
        elif verb == "register" and held and held[a % len(held)]:
            table = held[a % len(held)]
            blk, h = table[b % len(table)], b % HASHES
            if model.hash[blk] not in (None, h):
                continue  # a block's hash never changes: callers never ask
            owner = model.by_hash(h)
            assert alloc.register(blk, h) == (owner in (None, blk))
            if owner is None:
                model.hash[blk] = model.content[blk] = h
        elif verb == "finish" and held:
            # A sequence publishes every block it filled, then ends (the common life).
            ids = held.pop(a % len(held))
            for i, blk in enumerate(ids):
                h = (b + i) % HASHES
                if model.hash[blk] is None and model.by_hash(h) is None:
                    assert alloc.register(blk, h)
                    model.hash[blk] = model.content[blk] = h
            alloc.free(ids)
            model.release(ids)
        elif verb == "acquire":
            wanted = [(a + i * b) % HASHES for i in range(a % 4 + 1)]
            ids = alloc.acquire(wanted)
            expect = []
            for h in wanted:
                owner = model.by_hash(h)
                if owner is None:
                    break
                expect.append(owner)
            assert ids == expect
            for blk, h in zip(ids, wanted):
                assert model.content[blk] == h  # a hit always serves the KV it names
                model.lru.pop(blk, None)
                model.refs[blk] += 1
            held.append(ids)
        elif verb == "free" and held:
            ids = held.pop(a % len(held))
            alloc.free(ids)
            model.release(ids)
        elif verb == "pin" and held:
            ids = held.pop(a % len(held))
            alloc.pin(ids)
            for blk in ids:
                model.pins[blk] += 1
            pinned.append(ids)
        elif verb in ("unpin", "unpin_all") and pinned:
            # unpin_all: a dead decode worker's transfers at once, shared blocks repeated.
            groups = list(pinned) if verb == "unpin_all" else [pinned[a % len(pinned)]]
            for g in groups:
                pinned.remove(g)
            ids = [blk for g in groups for blk in g]
            alloc.unpin(ids)
            for blk in ids:
                model.pins[blk] -= 1
            model.release(ids)
        alloc.check_invariants()
        for blk in range(num_blocks):
            assert alloc.state(blk) is model.state(blk), blk
        counts = (alloc.num_free, alloc.num_cached, alloc.num_used, alloc.num_pinned)
        assert counts == tuple(
            sum(model.state(blk) is s for blk in range(num_blocks))
            for s in (BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.PINNED)
        )
        assert sum(counts) == num_blocks
        # Every block a sequence or transfer holds is held by the model with that many refs.
        holders = [blk for g in held + pinned for blk in g]
        assert all(holders.count(blk) == model.refs[blk] for blk in range(num_blocks))


def _filled(alloc: BlockAllocator, hashes: list[int]) -> list[int]:
    """A sequence's blocks, computed and published under ``hashes``, then freed."""
    ids = alloc.allocate(len(hashes))
    for blk, h in zip(ids, hashes):
        assert alloc.register(blk, h)
    alloc.free(ids)
    return ids


def test_cached_blocks_are_evicted_only_when_unreferenced_and_the_pool_is_full() -> None:
    alloc = BlockAllocator(6)
    a = _filled(alloc, [11, 12, 13])
    assert (alloc.num_free, alloc.num_cached, alloc.num_available) == (3, 3, 6)
    held = alloc.allocate(3)  # free blocks first: the cache is untouched
    assert set(held).isdisjoint(a) and alloc.lookup([11, 12, 13]) == 3
    shared = alloc.acquire([11, 12, 99])  # a hit stops at the first unknown hash
    assert shared == a[:2] and alloc.num_cached == 1
    (evicted,) = alloc.allocate(1)  # the pool is full: the one unreferenced cached block
    assert evicted == a[2] and alloc.lookup([11, 12, 13]) == 2
    with pytest.raises(NoFreeBlocks):
        alloc.allocate(1)  # 11 and 12 are referenced: never evicted
    assert alloc.acquire([11, 12]) == a[:2]  # two holders now
    alloc.free(shared)
    assert alloc.num_cached == 0  # still held by the second acquisition
    alloc.check_invariants()


def test_eviction_takes_a_chains_tail_first_and_least_recently_used_first() -> None:
    alloc = BlockAllocator(5)
    old = _filled(alloc, [1, 2])
    new = _filled(alloc, [7, 8, 9])
    assert alloc.num_free == 0
    assert alloc.allocate(1) == [old[1]]  # the older chain's tail, not its head
    assert alloc.allocate(1) == [old[0]]
    assert alloc.allocate(1) == [new[2]]
    assert alloc.lookup([7, 8, 9]) == 2


def test_a_duplicate_registration_stays_private_and_is_freed_as_free() -> None:
    alloc = BlockAllocator(4)
    first, second = alloc.allocate(1), alloc.allocate(1)
    assert alloc.register(first[0], 5)
    assert not alloc.register(second[0], 5)  # the first copy wins
    alloc.free(second)
    assert alloc.state(second[0]) is BlockState.FREE
    assert alloc.acquire([5]) == first


def test_shared_pinned_blocks_stay_pinned_until_every_transfer_releases_them() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    alloc.register(a[0], 3)
    b = alloc.acquire([3]) + alloc.allocate(1)
    alloc.pin(a)
    alloc.pin(b)
    assert alloc.num_pinned == 3
    alloc.unpin(a)
    assert alloc.state(a[0]) is BlockState.PINNED and alloc.state(a[1]) is BlockState.FREE
    alloc.unpin(b)
    assert alloc.state(a[0]) is BlockState.CACHED and alloc.num_pinned == 0
    alloc.check_invariants()


def test_allocation_beyond_available_raises_and_changes_nothing() -> None:
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    with pytest.raises(NoFreeBlocks) as err:
        alloc.allocate(2)
    assert (err.value.wanted, err.value.free) == (2, 1)
    assert alloc.num_free == 1
    alloc.free(first)
    assert sorted(alloc.allocate(4)) == [0, 1, 2, 3]


def test_wrong_state_transitions_are_rejected_without_side_effects() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.unpin(ids)  # used, not pinned
    alloc.pin(ids)
    with pytest.raises(ValueError):
        alloc.free(ids)  # pinned blocks are not freed behind the transfer's back
    (other,) = alloc.allocate(1)
    (never_allocated,) = set(range(4)) - {*ids, other}
    with pytest.raises(ValueError):
        alloc.free([other, never_allocated])  # one bad id: nothing moves
    with pytest.raises(ValueError):
        alloc.free([other, other])  # one reference cannot be dropped twice
    assert (alloc.num_free, alloc.num_used, alloc.num_pinned) == (1, 1, 2)
    alloc.unpin(ids)
    alloc.free([other])
    alloc.check_invariants()
    assert alloc.num_free == 4


# ---- hashes --------------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 200_000), max_size=70)


@settings(max_examples=100, deadline=None)
@given(tokens=TOKENS, more=TOKENS, block_size=st.integers(1, 8))
def test_block_hashes_name_prefixes_and_continue_a_chain(
    tokens: list[int], more: list[int], block_size: int
) -> None:
    whole = block_hashes(tokens + more, block_size)
    assert len(whole) == (len(tokens) + len(more)) // block_size
    head = block_hashes(tokens, block_size)
    assert whole[: len(head)] == head  # a block's hash depends on its prefix only
    cut = len(head) * block_size
    tail = block_hashes((tokens + more)[cut:], block_size, parent=head[-1] if head else None)
    assert head + tail == whole
    if whole:
        assert block_hashes(tokens + more, block_size, extra=b"adapter-1") != whole


def test_block_hashes_differ_when_any_earlier_token_differs() -> None:
    base = list(range(32))
    changed = [*base[:3], 999, *base[4:]]
    a, b = block_hashes(base, 16), block_hashes(changed, 16)
    assert a[0] != b[0] and a[1] != b[1]  # block 1's tokens are equal; its prefix is not


def test_block_hashes_are_the_same_in_every_process() -> None:
    # Pinned values: the frontend and router hash prompts in other processes (and, for
    # routing across restarts, other runs), so the scheme must not depend on the process.
    code = "from engine.kv.block_allocator import block_hashes as h; print(h(list(range(40)), 16))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(block_hashes(list(range(40)), 16))
    assert block_hashes(list(range(40)), 16) == EXPECTED_RANGE40_BS16
    assert root_hash() != root_hash(b"x")


EXPECTED_RANGE40_BS16 = [15925503794245111985, 4606966321359326692]


def test_shared_blocks_live_until_every_sharer_frees_them() -> None:
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.share(blocks)  # a fork of the sequence holding them
    a.pin(blocks)  # one sharer's transfer
    a.free(blocks)  # the other sharer is done
    assert a.num_pinned == 2 and a.num_free == 2
    a.unpin(blocks)
    assert a.num_free == 4
    a.check_invariants()
    with pytest.raises(ValueError, match="in use"):
        a.share([3])  # only blocks in use can be shared


def test_forgetting_hashes_frees_cached_blocks_and_hides_used_ones() -> None:
    a = BlockAllocator(8)
    a.watch_hashes()
    hashes = block_hashes(list(range(64)), 16)  # 4 blocks
    used = a.allocate(4)
    for b, h in zip(used, hashes, strict=True):
        a.register(b, h)
    a.free(used[2:])  # blocks 2-3 cached, 0-1 still used
    a.take_hash_changes()
    assert a.forget_hashes() == 4
    a.check_invariants()
    assert a.lookup(hashes) == 0 and a.num_cached == 0 and a.num_used == 2
    assert a.take_hash_changes() == ([], hashes)  # the summary stops reporting them
    a.free(used[:2])  # the used ones come back FREE, never CACHED
    assert a.num_free == 8
    a.check_invariants()


def test_a_freed_block_is_reused_before_a_never_used_one() -> None:
    """Its pages are resident already: reusing it first faults nothing in, and a pool
    without prefix caching stays as small in memory as its busiest moment."""
    a = BlockAllocator(8)
    first = a.allocate(3)
    a.free(first)
    assert a.allocate(4) == [*first, 3]


def test_forgotten_cached_blocks_are_handed_out_before_never_used_ones() -> None:
    a = BlockAllocator(8)
    ids = a.allocate(3)
    for b, h in zip(ids, (11, 12, 13), strict=True):
        a.register(b, h)
    a.free(ids)
    assert a.forget_hashes() == 3
    assert sorted(a.allocate(3)) == sorted(ids)
