"""The cache-aware router counts a prefix in the host's KV tiers (tier 2 in a real
shared-memory store, tier 3 as real block files) as a hit for every worker of that host,
after what each worker's own pool holds."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np

from engine.kv.block_allocator import block_hashes
from engine.kv.tiers.disk_store import DiskStore
from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.keys import chain_keys, root_key
from router.policy import PolicyName
from router.router import PromptBlocks, Router
from router.tier_residency import TierResidency
from transport.load_table import LoadTable, WorkerState
from transport.prefix_summary import PrefixSummary, summary_nbytes
from wire.roles import Role

BS = 16
PAYLOAD = 64
NS = bytes(range(16))


def _host(slots: int = 64, namespace: bytes | None = NS) -> HostStore:
    """A tier-2 store whose blocks a worker named ``namespace`` (None: no worker yet)."""
    g = Geometry(slots, BS, PAYLOAD)
    fd, buf = create_segment(g.offsets[3])
    HostStore.format(buf, g)
    host = HostStore(fd, buf)
    if namespace is not None:
        assert host.adopt_namespace(namespace) == namespace
    return host


def _store(
    host: HostStore | None, disk: DiskStore | None, prompt: list[int], blocks: range
) -> None:
    """Put ``prompt``'s blocks ``blocks`` into tier 2 (``host``) or tier 3 (``disk``)."""
    keys = chain_keys(root_key(NS, None), prompt, BS)
    for i in blocks:
        parent = keys[i - 1] if i else root_key(NS, None)
        tokens = np.asarray(prompt[i * BS : (i + 1) * BS], dtype="<u4")
        payload = np.full(PAYLOAD, i, dtype=np.uint8)
        if host is not None:
            assert host.put(keys[i], parent, tokens, payload)
        if disk is not None:
            assert disk.write(keys[i], parent, tokens, payload) > 0


def _table(nodes: list[str], queued: list[int]) -> LoadTable:
    """Prefill workers on ``nodes`` with ``queued`` prompt tokens each, one decode worker."""
    n = len(nodes) + 1
    table = LoadTable(bytearray(LoadTable.layout_nbytes(n)), n)
    for i, (node, q) in enumerate(zip(nodes, queued, strict=True)):
        w = table.writer(i)
        w.claim(Role.PREFILL, i, pid=os.getpid(), block_size=BS, node=node)
        w.publish(queued_prefill_tokens=q)
        w.set_state(WorkerState.READY)
    w = table.writer(n - 1)
    w.claim(Role.DECODE, 0, pid=os.getpid(), block_size=BS, node=nodes[0])
    w.publish(free_kv_blocks=4096, total_kv_blocks=4096)
    w.set_state(WorkerState.READY)
    return table


def _summaries(n: int) -> dict[tuple[Role, int], PrefixSummary]:
    out = {
        (Role.PREFILL, i): PrefixSummary(bytearray(summary_nbytes(1 << 12)), 1 << 12)
        for i in range(n)
    }
    out[(Role.DECODE, 0)] = PrefixSummary(bytearray(summary_nbytes(1 << 12)), 1 << 12)
    return out


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def test_a_run_is_tier2_then_tier3_from_where_tier2_stopped(tmp_path: Path) -> None:
    host = _host()
    disk = DiskStore(tmp_path, NS, BS, PAYLOAD)
    prompt = _prompt(1, 40 * BS)
    _store(host, None, prompt, range(0, 20))
    _store(None, disk, prompt, range(20, 30))
    _store(None, disk, prompt, range(31, 40))  # after a gap: never part of a run
    q = TierResidency(host, tmp_path).query(prompt, BS)
    assert q is not None
    assert q.run(0) == 30
    assert q.run(5) == 25  # a pool holding 5 blocks loads the next 25
    assert q.run(30) == 0
    # Without tier 3 the run ends where tier 2 does; another namespace holds nothing.
    assert TierResidency(host, None).query(prompt, BS).run(0) == 20  # type: ignore[union-attr]
    other = TierResidency(_host(namespace=bytes(range(1, 17))), tmp_path).query(prompt, BS)
    assert other is not None and other.run(0) == 0
    assert TierResidency(host, tmp_path).query(prompt, 2 * BS) is None
    # Before a worker has named the blocks the tiers answer nothing, then read its name.
    unnamed = _host(namespace=None)
    late = TierResidency(unnamed, tmp_path)
    assert late.query(prompt, BS) is None
    assert unnamed.adopt_namespace(NS) == NS and unnamed.adopt_namespace(bytes(range(1, 17))) == NS
    assert late.query(prompt, BS).run(20) == 10  # type: ignore[union-attr]
    host.clear()  # tier 2 emptied: tier 3 holds nothing from block 0
    assert TierResidency(host, tmp_path).query(prompt, BS).run(0) == 0  # type: ignore[union-attr]


def test_a_tier_hit_draws_the_request_to_a_busier_worker_of_the_tiers_host(
    tmp_path: Path,
) -> None:
    host = _host()
    disk = DiskStore(tmp_path, NS, BS, PAYLOAD)
    prompt = _prompt(2, 40 * BS)
    _store(host, None, prompt, range(0, 20))
    _store(None, disk, prompt, range(20, 35))
    # p0 and p1 share the tiers' node; p2 is on another host. p0 is the busiest.
    table = _table(["here", "here", "there"], queued=[300, 200, 0])
    tiers = TierResidency(host, tmp_path, node="here")

    plain = Router(table, PolicyName.CACHE_AWARE, summaries=_summaries(3))
    p = plain.place(len(prompt), 8, plain.hash_blocks(prompt))
    assert p.prefill == 2  # no tiers: nothing held anywhere, the idle worker wins
    plain.release(p)

    aware = Router(table, PolicyName.CACHE_AWARE, summaries=_summaries(3), tiers=tiers)
    hashes = aware.hash_blocks(prompt)
    assert isinstance(hashes, PromptBlocks) and hashes == block_hashes(prompt, BS)
    p = aware.place(len(prompt), 8, hashes)
    # 35 of 40 blocks in the tiers: p1 computes 80 tokens behind 200 queued, p2 all 640.
    assert p.prefill == 1
    aware.release(p)


def test_tier_blocks_count_after_the_pool_prefix_of_each_worker(tmp_path: Path) -> None:
    host = _host()
    prompt = _prompt(3, 40 * BS)
    _store(host, None, prompt, range(10, 40))  # tier 2 lacks the first 10 blocks
    table = _table(["here", "here"], queued=[100, 0])
    summaries = _summaries(2)
    summaries[(Role.PREFILL, 0)].update(block_hashes(prompt, BS)[:10], [])  # p0's pool
    tiers = TierResidency(host, None, node="here")
    router = Router(table, PolicyName.CACHE_AWARE, summaries=summaries, tiers=tiers)
    p = router.place(len(prompt), 8, router.hash_blocks(prompt))
    # p0: 10 blocks in its pool, the other 30 from tier 2; p1's pool has none, and tier 2
    # alone has no run from block 0: p0 wins despite its queue.
    assert p.prefill == 0
    router.release(p)
