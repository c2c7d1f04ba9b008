"""Placement: balance under bursts, never a dead/draining/stale worker, bounded admission."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from router.policy import Candidate, PolicyName, PowerOfTwo, RoundRobin
from router.router import NoCapacity, Placement, Router, RouterConfig
from tests.router.sim import Cluster, check_bursts_spread, mixed_request, spread, start_cluster
from transport.load_table import LoadTable, WorkerState
from wire.roles import Role


def _cluster(n_prefill: int = 2, n_decode: int = 4, total_blocks: int = 8192) -> Cluster:
    buf = bytearray(LoadTable.layout_nbytes(n_prefill + n_decode))
    return start_cluster(buf, n_prefill, n_decode, total_blocks)


@pytest.mark.parametrize("seed", range(5))
def test_64_mixed_requests_put_every_worker_within_25_percent_of_mean_token_load(
    seed: int,
) -> None:
    rng = random.Random(seed)
    cluster = _cluster(2, 4)
    router = Router(cluster.table, PolicyName.LEAST_LOAD)

    def place(prompt: int, max_tokens: int) -> Placement:
        p = router.place(prompt, max_tokens)
        cluster.prefills[p.prefill].ring.append(p)
        return p

    check_bursts_spread(cluster, router, rng, place)


def test_a_burst_between_two_table_updates_still_spreads_evenly() -> None:
    rng = random.Random(7)
    cluster = _cluster(2, 4)
    router = Router(cluster.table)
    prefill_load: dict[int, int] = defaultdict(int)
    decode_count: dict[int, int] = defaultdict(int)
    for _ in range(64):
        prompt, max_tokens = mixed_request(rng)
        p = router.place(prompt, max_tokens)
        prefill_load[p.prefill] += prompt
        decode_count[p.decode] += 1
    assert spread(prefill_load, 2) <= 0.25
    assert sorted(decode_count) == [0, 1, 2, 3] and min(decode_count.values()) >= 8


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("policy", list(PolicyName))
def test_dead_draining_and_starting_workers_are_never_chosen(policy: PolicyName) -> None:
    cluster = _cluster(3, 3)
    # prefill 0 draining, prefill 1 dead pid; decode 0 starting, decode 2 marked DEAD.
    cluster.prefills[0].writer.set_state(WorkerState.DRAINING)
    cluster.prefills[1].writer.claim(Role.PREFILL, 1, pid=_dead_pid())
    cluster.prefills[1].writer.set_state(WorkerState.READY)
    cluster.decodes[0].writer.set_state(WorkerState.STARTING)
    cluster.decodes[2].writer.set_state(WorkerState.DEAD)
    router = Router(cluster.table, policy, RouterConfig(seed=1))
    placements = [router.place(100, 50) for _ in range(40)]
    assert {p.prefill for p in placements} == {2}
    assert {p.decode for p in placements} == {1}


def test_a_worker_whose_heartbeat_went_stale_is_never_chosen() -> None:
    cluster = _cluster(2, 2)
    router = Router(cluster.table, config=RouterConfig(stale_after_s=0.2))
    time.sleep(0.3)  # every row is now stale; refresh all but prefill 0 and decode 1
    cluster.prefills[1].writer.publish()
    cluster.decodes[0].writer.publish()
    placements = [router.place(64, 8) for _ in range(10)]
    assert {(p.prefill, p.decode) for p in placements} == {(1, 0)}


def test_no_live_worker_of_a_role_raises_no_capacity_with_the_dead_retry_delay() -> None:
    cluster = _cluster(1, 2)
    cluster.decodes[0].writer.set_state(WorkerState.DRAINING)
    cluster.decodes[1].writer.set_state(WorkerState.DEAD)
    router = Router(cluster.table, config=RouterConfig(retry_after_dead_s=7.0))
    with pytest.raises(NoCapacity) as err:
        router.place(10, 10)
    assert err.value.retry_after_s == 7.0 and "decode" in err.value.reason


def test_waiting_request_bound_turns_overload_into_no_capacity_until_workers_drain() -> None:
    cluster = _cluster(2, 2)
    router = Router(cluster.table, config=RouterConfig(max_waiting_requests=4, retry_after_s=2.0))
    # Nothing reported yet: the router's own in-flight count enforces the bound.
    sent = [router.place(32, 4) for _ in range(8)]
    with pytest.raises(NoCapacity) as err:
        router.place(32, 4)
    assert err.value.retry_after_s == 2.0
    for p in sent:
        cluster.prefills[p.prefill].ring.append(p)
    for _ in range(10):  # prefill, hand over, decode 4 tokens, finish, release
        cluster.step(router)
    assert router.ledger.in_flight() == 0
    router.place(32, 4)


def test_check_capacity_refuses_exactly_when_place_would_refuse_a_one_token_prompt() -> None:
    cluster = _cluster(2, 2)
    router = Router(cluster.table, config=RouterConfig(max_waiting_requests=3, retry_after_s=2.0))
    for _ in range(6):
        router.check_capacity()  # commits nothing: may be asked any number of times
        router.place(32, 4)
    with pytest.raises(NoCapacity) as err:
        router.check_capacity()
    assert err.value.retry_after_s == 2.0
    with pytest.raises(NoCapacity):
        router.place(1, 1)
    assert router.ledger.in_flight() == 6


def test_check_capacity_reports_a_role_with_no_live_worker() -> None:
    cluster = _cluster(1, 1)
    cluster.prefills[0].writer.set_state(WorkerState.DEAD)
    router = Router(cluster.table, config=RouterConfig(retry_after_dead_s=7.0))
    with pytest.raises(NoCapacity) as err:
        router.check_capacity()
    assert err.value.retry_after_s == 7.0 and "prefill" in err.value.reason


def test_queued_token_bound_rejects_more_work_but_an_idle_worker_takes_a_huge_prompt() -> None:
    cluster = _cluster(1, 1)
    router = Router(cluster.table, config=RouterConfig(max_queued_prefill_tokens=1000))
    router.place(5000, 1)  # idle worker: admitted however long
    with pytest.raises(NoCapacity):
        router.place(10, 1)


def test_an_undelivered_placement_released_stops_counting_against_its_worker() -> None:
    cluster = _cluster(2, 1)
    router = Router(cluster.table)
    first = router.place(1000, 10)
    router.release(first, delivered=False)
    # With the undelivered 1000 tokens forgotten, the same (cheapest, lowest) worker wins.
    assert router.place(500, 10).prefill == first.prefill
    assert router.ledger.in_flight() == 1


def test_a_restarted_worker_starts_with_fresh_accounting() -> None:
    cluster = _cluster(2, 1)
    router = Router(cluster.table)
    old = [router.place(2000, 10) for _ in range(2)]
    assert {p.prefill for p in old} == {0, 1}
    # Prefill 0 restarts: new generation, nothing queued; its old in-flight work is gone.
    w = cluster.prefills[0].writer
    w.claim(Role.PREFILL, 0, pid=os.getpid())
    w.set_state(WorkerState.READY)
    p = router.place(100, 10)
    assert p.prefill == 0 and p.prefill_generation == old[0].prefill_generation + 1
    router.release(old[0])  # a release for the dead generation changes nothing
    assert router.place(100, 10).prefill == 0


def test_colocated_workers_get_both_halves_of_a_request() -> None:
    buf = bytearray(LoadTable.layout_nbytes(3))
    table = LoadTable(buf, 3)
    for i in range(3):
        w = table.writer(i)
        w.claim(Role.COLOCATED, i, block_size=16)
        w.publish(free_kv_blocks=100, total_kv_blocks=100)
        w.set_state(WorkerState.READY)
    router = Router(table)
    placements = [router.place(100, 100) for _ in range(9)]
    assert all(p.prefill == p.decode for p in placements)
    assert sorted(p.prefill for p in placements) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_at_low_load_work_alternates_between_idle_workers() -> None:
    # Every request finishes before the next arrives, so every cost reads 0: the tokens
    # assigned so far break the tie, not the worker index.
    cluster = _cluster(2, 4)
    router = Router(cluster.table)
    prefill_load: dict[int, int] = defaultdict(int)
    decode_load: dict[int, int] = defaultdict(int)
    for _ in range(24):
        p = router.place(100, 8)
        cluster.prefills[p.prefill].ring.append(p)
        prefill_load[p.prefill] += 100
        decode_load[p.decode] += 108
        for _ in range(12):  # prefill, hand over, decode 8 tokens, finish, release
            cluster.step(router)
        assert router.ledger.in_flight() == 0
    assert dict(prefill_load) == {0: 1200, 1: 1200}
    assert dict(decode_load) == {0: 648, 1: 648, 2: 648, 3: 648}
    assigned = router.assigned()
    assert assigned[(Role.PREFILL, 0)] == (12, 1200) and assigned[(Role.DECODE, 3)] == (6, 648)


def test_an_undelivered_placement_is_not_counted_as_assigned() -> None:
    cluster = _cluster(1, 1)
    router = Router(cluster.table)
    kept = router.place(30, 5)
    router.release(router.place(1000, 10), delivered=False)
    assert router.assigned() == {(Role.PREFILL, 0): (1, 30), (Role.DECODE, 0): (1, 35)}
    router.release(kept)  # a delivered request stays assigned after it ends
    assert router.assigned()[(Role.DECODE, 0)] == (1, 35)


def test_round_robin_cycles_over_routable_workers_in_index_order() -> None:
    rr = RoundRobin()
    cands = [Candidate(0, 9), Candidate(2, 0), Candidate(3, 5)]
    assert [rr.choose(cands).index for _ in range(5)] == [0, 2, 3, 0, 2]


def test_power_of_two_keeps_the_cheaper_of_its_two_samples() -> None:
    p2 = PowerOfTwo(seed=3)
    cands = [Candidate(0, 100), Candidate(1, 0)]
    assert all(p2.choose(cands).index == 1 for _ in range(20))
    cands3 = [Candidate(0, 0), Candidate(1, 50), Candidate(2, 100)]
    picks = {p2.choose(cands3).index for _ in range(200)}
    assert picks == {0, 1}  # the most loaded can never win a pair


def test_bad_request_sizes_are_value_errors() -> None:
    router = Router(_cluster(1, 1).table)
    with pytest.raises(ValueError, match="prompt_len"):
        router.place(0, 10)


def test_placement_carries_the_role_indices_used_in_request_records() -> None:
    cluster = _cluster(1, 2)
    p = Router(cluster.table).place(10, 10)
    assert isinstance(p, Placement) and p.prefill == 0 and p.decode in (0, 1)
