"""The router prefers workers it sent an adapter to, while their load stays close to the
least loaded worker's, and forgets the least recently used adapters as workers do."""

from __future__ import annotations

from router.lora_affinity import AdapterAffinity
from router.router import Router, RouterConfig
from tests.router.sim import start_cluster
from transport.load_table import LoadTable


def test_an_adapter_stays_on_the_workers_that_hold_it_at_a_similar_load() -> None:
    cluster = start_cluster(bytearray(LoadTable.layout_nbytes(2 + 2)), 2, 2, 8192)
    router = Router(cluster.table, config=RouterConfig(max_loras=2))
    first = router.place(64, 16, lora="fp-a")
    cluster.prefills[first.prefill].ring.append(first)
    cluster.step(router)
    # Plain requests alternate between the workers; the adapter's stay where it went.
    for _ in range(6):
        p = router.place(64, 16, lora="fp-a")
        assert (p.prefill, p.decode) == (first.prefill, first.decode)
        cluster.prefills[p.prefill].ring.append(p)
        cluster.step(router)
    other = router.place(64, 16, lora="fp-b")
    assert other.prefill != first.prefill  # a new adapter goes to the less loaded worker


def test_a_huge_load_gap_overrides_the_preference() -> None:
    cluster = start_cluster(bytearray(LoadTable.layout_nbytes(2 + 2)), 2, 2, 8192)
    router = Router(cluster.table, config=RouterConfig(max_loras=2))
    first = router.place(64, 16, lora="fp-a")
    for _ in range(3):  # unsent work far past the slack piles up on the holder
        router.place(4096, 16, prefill=first.prefill)
    p = router.place(64, 16, lora="fp-a")
    assert p.prefill != first.prefill


def test_each_worker_remembers_at_most_max_loras_adapters_least_recent_out() -> None:
    a = AdapterAffinity(per_worker=2)
    for fp in ("x", "y", "x", "z"):
        a.sent("w", fp)
    assert a.holds("w", "x") and a.holds("w", "z") and not a.holds("w", "y")


def test_an_unloaded_adapter_is_forgotten_on_every_worker() -> None:
    affinity = AdapterAffinity(per_worker=2)
    for worker in ("p0", "p1"):
        affinity.sent(worker, "a")
        affinity.sent(worker, "b")
    affinity.forget("a")
    assert not affinity.holds("p0", "a") and not affinity.holds("p1", "a")
    assert affinity.holds("p0", "b") and affinity.holds("p1", "b")
