"""Cache-aware placement: conversations stay where their history is; load stays even.

Simulated workers (``tests/router/sim.py``) hold the blocks of what they computed and
publish them in real prefix summaries; the router reads those summaries, as in a
launched server.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from engine.kv.block_allocator import block_hashes
from router.policy import CacheAffinity, CacheAware, Candidate, Policy, PolicyName
from router.router import Placement, Router
from tests.router.sim import BLOCK, Cluster, check_bursts_spread, start_cluster
from transport.load_table import LoadTable


def _cluster(n_prefill: int, n_decode: int) -> Cluster:
    buf = bytearray(LoadTable.layout_nbytes(n_prefill + n_decode))
    return start_cluster(buf, n_prefill, n_decode)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 150_000) for _ in range(n)]


def _send(router: Router, cluster: Cluster, prompt: list[int], reply: list[int]) -> Placement:
    """Place a request as the frontend does: hash once, place, send to prefill."""
    p = router.place(len(prompt), len(reply), router.hash_blocks(prompt))
    # What each worker holds afterwards: prefill the prompt, decode prompt + reply.
    cluster.hashes[p.ticket] = (block_hashes(prompt, BLOCK), block_hashes(prompt + reply, BLOCK))
    cluster.prefills[p.prefill].ring.append(p)
    return p


def _pick(policy: Policy, *workers: tuple[int, int]) -> int:
    """The index ``policy`` chooses among workers given as (cost, new_tokens)."""
    candidates = [Candidate(i, cost=cost, new_tokens=new) for i, (cost, new) in enumerate(workers)]
    return policy.choose(candidates).index


def test_the_cheapest_after_reuse_wins_and_ties_fall_back_to_load() -> None:
    policy = CacheAware()
    # Worker 1 holds 900 of 1000 prompt tokens: its 400 queued tokens are worth it.
    assert _pick(policy, (0, 1000), (400, 100)) == 1
    # ...but not a queue longer than the history it saves.
    assert _pick(policy, (0, 1000), (950, 100)) == 0
    assert _pick(policy, (10, 500), (0, 500)) == 1


def test_decode_takes_the_longest_held_prefix_only_among_workers_near_the_least_loaded() -> None:
    policy = CacheAffinity(band=0.25)
    # Request KV 1000; worker 1 holds 800 of it and is within 25 % + one request's KV.
    assert _pick(policy, (8000, 1000), (10_500, 200)) == 1
    assert _pick(policy, (8000, 1000), (11_500, 200)) == 0
    # Nothing held anywhere: least load, as LeastLoad picks.
    assert _pick(policy, (300, 1000), (200, 1000)) == 1


@dataclass
class _Conversation:
    history: list[int]
    turns_left: int
    busy: Placement | None = None
    last: Placement | None = None
    reply: list[int] = field(default_factory=list)


def test_turns_of_a_conversation_land_where_their_history_is() -> None:
    rng = random.Random(5)
    cluster = _cluster(2, 2)
    router = Router(cluster.table, PolicyName.CACHE_AWARE, summaries=cluster.summaries())
    system = _tokens(rng, 96)  # one system prompt shared by every conversation
    convs = [
        _Conversation(system + _tokens(rng, rng.randint(20, 200)), turns_left=6) for _ in range(24)
    ]
    stuck = {"prefill": 0, "decode": 0}
    later_turns = 0
    prefill_turns: dict[int, int] = defaultdict(int)
    for _ in range(5000):
        for c in convs:
            if c.busy is not None and c.busy.ticket not in _in_flight(router):
                c.history += c.reply + _tokens(rng, rng.randint(10, 120))  # reply, next message
                c.last, c.busy = c.busy, None
            if c.busy is None and c.turns_left and rng.random() < 0.05:  # the user types
                c.reply = _tokens(rng, rng.randint(16, 200))
                c.busy = _send(router, cluster, c.history, c.reply)
                c.turns_left -= 1
                prefill_turns[c.busy.prefill] += 1
                if c.last is not None:
                    later_turns += 1
                    stuck["prefill"] += c.busy.prefill == c.last.prefill
                    stuck["decode"] += c.busy.decode == c.last.decode
        cluster.step(router)
        if not any(c.turns_left or c.busy for c in convs):
            break
    assert later_turns == 24 * 5
    assert stuck["prefill"] >= 0.9 * later_turns, stuck
    assert stuck["decode"] >= 0.9 * later_turns, stuck
    assert min(prefill_turns.values()) >= 0.25 * sum(prefill_turns.values()), prefill_turns


def _in_flight(router: Router) -> set[int]:
    return {t for books in router.ledger.books.values() for t in books.reserved}


@pytest.mark.parametrize("seed", range(5))
def test_without_shared_prefixes_load_stays_within_25_percent_of_the_mean(seed: int) -> None:
    # The load-only placement bound (tests/router/test_policy.py), under cache-aware routing
    # with every worker publishing the blocks it holds: nothing is shared, nothing sticks.
    rng = random.Random(seed)
    cluster = _cluster(2, 4)
    router = Router(cluster.table, PolicyName.CACHE_AWARE, summaries=cluster.summaries())

    def place(prompt_len: int, max_tokens: int) -> Placement:
        return _send(router, cluster, _tokens(rng, prompt_len), _tokens(rng, max_tokens))

    check_bursts_spread(cluster, router, rng, place)


def test_load_only_policies_never_hash() -> None:
    cluster = _cluster(1, 1)
    router = Router(cluster.table, PolicyName.LEAST_LOAD, summaries=cluster.summaries())
    assert router.hash_blocks(list(range(100))) == []
    aware = Router(cluster.table, PolicyName.CACHE_AWARE, summaries=cluster.summaries())
    assert aware.hash_blocks(list(range(100))) == block_hashes(list(range(100)), BLOCK)
