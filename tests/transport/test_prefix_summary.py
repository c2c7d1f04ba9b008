"""The shared prefix summary: counts held prefixes, forgets evictions, never garbage."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import random

import pytest

from engine.kv.block_allocator import BlockAllocator, block_hashes
from transport.prefix_summary import (
    PrefixSummary,
    summary_counters,
    summary_nbytes,
)


def _summary(m: int = 1 << 12) -> tuple[mmap.mmap, PrefixSummary]:
    buf = mmap.mmap(-1, summary_nbytes(m))
    return buf, PrefixSummary(buf, m)


def test_a_second_view_reads_what_the_writer_counted() -> None:
    buf, w = _summary()
    chain = block_hashes(list(range(100)), 16)  # 6 full blocks
    w.update(chain[:4], [])
    r = PrefixSummary(buf)  # the header gives the size
    assert r.num_counters == 1 << 12
    assert r.count_prefix(chain) == 4
    assert r.count_prefix(chain[:2]) == 2 and r.count_prefix([]) == 0
    other = block_hashes([7, *range(100)], 16)
    assert r.count_prefix(other) == 0


def test_removed_hashes_stop_counting_and_shared_counters_survive() -> None:
    _, s = _summary()
    rng = random.Random(1)
    hashes = [rng.getrandbits(64) for _ in range(300)]
    s.update(hashes, [])
    assert s.contains(hashes).all()
    s.update([], hashes[:150])
    assert s.contains(hashes[150:]).all()  # counters shared with removed ones still count
    assert s.contains(hashes[:150]).sum() <= 3  # false positives only
    _, fresh = _summary()
    fresh.update(hashes[:1], hashes[:1])  # registered and evicted within one step
    assert fresh.load == 0.0


def test_false_positive_rate_at_the_planned_load_is_a_few_percent() -> None:
    m = summary_counters(1000)
    assert m == 8192  # 8 counters per block, rounded up to a power of two
    _, s = _summary(m)
    rng = random.Random(2)
    s.update([rng.getrandbits(64) for _ in range(1000)], [])
    absent = [rng.getrandbits(64) for _ in range(20_000)]
    assert s.contains(absent).mean() < 0.04


def test_summary_follows_an_allocator_journal_through_evictions() -> None:
    a = BlockAllocator(8)
    a.watch_hashes()
    _, s = _summary()
    chains = [block_hashes([i] * 64, 16) for i in range(4)]  # 4 chains of 4 blocks
    for chain in chains:
        blocks = a.allocate(4)  # evicts the oldest cached chain once the pool is full
        for b, h in zip(blocks, chain, strict=True):
            a.register(b, h)
        a.free(blocks)
        s.update(*a.take_hash_changes())
    held = [a.lookup(c) for c in chains]
    assert held == [0, 0, 4, 4]
    assert [s.count_prefix(c) for c in chains] == held


def test_saturated_counters_stay_saturated() -> None:
    _, s = _summary(1 << 12)
    h = [12345]
    s.update(h * 300, [])  # one hash listed 300 times: its counters hit 255
    s.update([], h * 300)
    assert s.contains(h)[0]  # saturated: the true count is unknown, kept


def test_a_fresh_buffer_needs_a_power_of_two_size() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        PrefixSummary(bytearray(summary_nbytes(1000)), 1000)
    with pytest.raises(ValueError, match="not a prefix summary"):
        PrefixSummary(b"\x01" * 128 + bytes(4096))


def _writer(buf: mmap.mmap, chains: list[list[int]], rounds: int) -> None:
    s = PrefixSummary(buf)
    for _ in range(rounds):
        for c in chains:
            s.update(c, [])
        for c in chains:
            s.update([], c)
    s.update(chains[0], [])


def test_reads_racing_a_writer_in_another_process_see_only_real_prefix_lengths() -> None:
    buf, s = _summary(1 << 14)
    stable = block_hashes(list(range(160)), 16)  # always held: 10 blocks
    s.update(stable, [])
    churn = [block_hashes([i] * 160, 16) for i in range(1, 5)]
    proc = mp.get_context("fork").Process(target=_writer, args=(buf, churn, 200))
    proc.start()
    reader = PrefixSummary(buf)
    seen = set()
    while proc.is_alive():
        assert reader.count_prefix(stable) == 10  # counters of others never drop it
        seen.add(reader.count_prefix(churn[0]))
    proc.join()
    assert proc.exitcode == 0
    assert seen <= set(range(11))
    assert reader.count_prefix(churn[0]) == 10
