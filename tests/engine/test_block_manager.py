"""The block allocator never loses, duplicates or double-hands-out a block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockAllocator, BlockState
from engine.errors import NoFreeBlocks

# An operation: (verb, size or index). Indices pick among the currently held groups.
OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "free", "pin", "release"]), st.integers(0, 12)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 24), ops=OPS)
def test_random_operations_keep_free_used_pinned_equal_to_total(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    alloc = BlockAllocator(num_blocks)
    used: list[list[int]] = []  # per "request": its block table
    pinned: list[list[int]] = []
    for verb, arg in ops:
        before = (alloc.num_free, alloc.num_used, alloc.num_pinned)
        if verb in ("alloc", "append"):
            try:
                ids = alloc.allocate(arg)
            except NoFreeBlocks:
                assert arg > before[0]
                assert (alloc.num_free, alloc.num_used, alloc.num_pinned) == before
                continue
            if verb == "append" and used:
                used[arg % len(used)].extend(ids)
            else:
                used.append(ids)
        elif verb == "free" and used:
            alloc.free(used.pop(arg % len(used)))
        elif verb == "pin" and used:
            group = used.pop(arg % len(used))
            alloc.pin(group)
            pinned.append(group)
        elif verb == "release" and pinned:
            alloc.unpin_and_free(pinned.pop(arg % len(pinned)))
        alloc.check_invariants()
        held = [b for g in used for b in g]
        held_pinned = [b for g in pinned for b in g]
        assert len(set(held + held_pinned)) == len(held) + len(held_pinned)
        assert alloc.num_used == len(held)
        assert alloc.num_pinned == len(held_pinned)
        assert alloc.num_free + alloc.num_used + alloc.num_pinned == num_blocks
        assert all(alloc.state(b) is BlockState.USED for b in held)
        assert all(alloc.state(b) is BlockState.PINNED for b in held_pinned)


def test_allocation_beyond_free_raises_and_changes_nothing() -> None:
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
        alloc.unpin_and_free(ids)  # used, not pinned
    alloc.pin(ids)
    with pytest.raises(ValueError):
        alloc.free(ids)  # pinned blocks are not freed behind the transfer's back
    (other,) = alloc.allocate(1)
    (never_allocated,) = set(range(4)) - {*ids, other}
    with pytest.raises(ValueError):
        alloc.free([other, never_allocated])  # one bad id: nothing moves
    assert (alloc.num_free, alloc.num_used, alloc.num_pinned) == (1, 1, 2)
    alloc.unpin_and_free(ids)
    alloc.free([other])
    alloc.check_invariants()
    assert alloc.num_free == 4
