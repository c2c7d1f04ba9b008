"""Simulated workers that report into a real load table the way the engines will.

A prefill worker drains its FIFO request ring at each step, prefills ``chunk`` tokens of
its queue per step, and hands finished prompts to their decode worker. A decode worker
admits transfers while it has KV blocks, grows each running request by one token per step
and finishes it after ``max_tokens`` outputs, releasing the placement as the frontend would.

Prefix caching, for requests the test lists in ``Cluster.hashes`` (ticket -> block hashes
prefill computes, block hashes decode ends up holding): a prefill worker skips the leading
blocks it holds (as ``KVPool.reuse_prefix`` does) and holds the prompt's blocks once
done; a decode worker holds its requests' blocks; both publish what they hold in their
prefix summary every step, as ``runtime.worker.Worker`` does. Caches never evict here.
"""

from __future__ import annotations

import math
import os
import random
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.router import Placement, Router
from transport.load_table import LoadTable, RowWriter, WorkerState
from transport.prefix_summary import PrefixSummary, summary_nbytes
from wire.roles import Role

BLOCK = 16
Hashes = dict[int, tuple[list[int], list[int]]]  # ticket -> (prefill's, decode's)


@dataclass
class SimCache:
    """What a simulated worker holds, mirrored into its prefix summary each step."""

    summary: PrefixSummary = field(
        default_factory=lambda: PrefixSummary(bytearray(summary_nbytes(1 << 16)), 1 << 16)
    )
    held: set[int] = field(default_factory=set)
    new: list[int] = field(default_factory=list)

    def leading(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        fresh = [h for h in hashes if h not in self.held]
        self.held.update(fresh)
        self.new += fresh

    def publish(self) -> None:
        self.summary.update(self.new, [])
        self.new = []


@dataclass
class _Job:
    placement: Placement
    left: int  # prompt tokens still to prefill, or output tokens still to decode
    kv_len: int = 0


@dataclass
class SimPrefill:
    writer: RowWriter
    chunk: int = 2048
    ring: deque[Placement] = field(default_factory=deque)
    queue: deque[_Job] = field(default_factory=deque)
    received: int = 0
    tokens_received: int = 0
    cache: SimCache = field(default_factory=SimCache)

    def step(self, decoders: list[SimDecode], hashes: Hashes) -> None:
        while self.ring:
            p = self.ring.popleft()
            self.received += 1
            self.tokens_received += p.prompt_len
            mine = hashes.get(p.ticket, ([], []))[0]
            cached = min(self.cache.leading(mine), (p.prompt_len - 1) // BLOCK) * BLOCK
            self.queue.append(_Job(p, p.prompt_len - cached))
        budget = self.chunk
        while self.queue and budget > 0:
            job = self.queue[0]
            done = min(budget, job.left)
            job.left -= done
            budget -= done
            if job.left == 0:
                self.queue.popleft()
                self.cache.add(hashes.get(job.placement.ticket, ([], []))[0])
                decoders[job.placement.decode].ring.append(job.placement)
        self.cache.publish()
        self.writer.publish(
            queued_prefill_tokens=sum(j.left for j in self.queue),
            waiting_requests=len(self.queue),
            requests_received=self.received,
            prompt_tokens_received=self.tokens_received,
        )


@dataclass
class SimDecode:
    writer: RowWriter
    total_blocks: int
    block_size: int = 16
    ring: deque[Placement] = field(default_factory=deque)
    running: list[_Job] = field(default_factory=list)
    cache: SimCache = field(default_factory=SimCache)

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def used(self) -> int:
        return sum(self.blocks(j.kv_len) for j in self.running)

    def step(self, router: Router, hashes: Hashes) -> None:
        while self.ring:
            p = self.ring[0]
            if self.used() + self.blocks(p.prompt_len + 1) > self.total_blocks:
                break
            self.ring.popleft()
            self.running.append(_Job(p, left=p.max_tokens - 1, kv_len=p.prompt_len + 1))
            self.cache.add(hashes.get(p.ticket, ([], []))[1])
        self.cache.publish()
        for j in self.running:
            j.kv_len += 1
            j.left -= 1
        for j in [j for j in self.running if j.left <= 0]:
            self.running.remove(j)
            router.release(j.placement)
        self.writer.publish(
            running_requests=len(self.running),
            waiting_requests=len(self.ring),
            free_kv_blocks=self.total_blocks - self.used(),
            total_kv_blocks=self.total_blocks,
        )


@dataclass
class Cluster:
    table: LoadTable
    prefills: list[SimPrefill]
    decodes: list[SimDecode]
    hashes: Hashes = field(default_factory=dict)

    def step(self, router: Router) -> None:
        for p in self.prefills:
            p.step(self.decodes, self.hashes)
        for d in self.decodes:
            d.step(router, self.hashes)

    def summaries(self) -> dict[tuple[Role, int], PrefixSummary]:
        """Every worker's prefix summary, as the frontend maps them for its router."""
        out = {(Role.PREFILL, i): p.cache.summary for i, p in enumerate(self.prefills)}
        out.update({(Role.DECODE, j): d.cache.summary for j, d in enumerate(self.decodes)})
        return out


def start_cluster(
    buf: bytearray, n_prefill: int, n_decode: int, total_blocks: int = 8192
) -> Cluster:
    """Claim one row per worker (all owned by this live process) and mark them READY."""
    table = LoadTable(buf, n_prefill + n_decode)
    prefills: list[SimPrefill] = []
    decodes: list[SimDecode] = []
    for i in range(n_prefill):
        w = table.writer(i)
        w.claim(Role.PREFILL, i, pid=os.getpid(), block_size=BLOCK)
        prefills.append(SimPrefill(w))
    for j in range(n_decode):
        w = table.writer(n_prefill + j)
        w.claim(Role.DECODE, j, pid=os.getpid(), block_size=BLOCK)
        decodes.append(SimDecode(w, total_blocks))
    for d in decodes:
        d.writer.publish(free_kv_blocks=total_blocks, total_kv_blocks=total_blocks)
    for writer in [p.writer for p in prefills] + [d.writer for d in decodes]:
        writer.set_state(WorkerState.READY)
    return Cluster(table, prefills, decodes)


def mixed_request(
    rng: random.Random, long: tuple[int, int] = (1024, 4096), output: tuple[int, int] = (16, 512)
) -> tuple[int, int]:
    """(prompt, max_tokens), chat-like: half short prompts, a third medium, some long
    documents in ``long``; outputs uniform in ``output``."""
    kind = rng.random()
    if kind < 0.5:
        prompt = rng.randint(16, 256)
    elif kind < 0.85:
        prompt = rng.randint(256, 1024)
    else:
        prompt = rng.randint(*long)
    return prompt, rng.randint(*output)


def spread(loads: dict[int, int], n: int) -> float:
    """Largest relative distance of a worker's load from the mean."""
    values = [loads.get(i, 0) for i in range(n)]
    mean = sum(values) / n
    return max(abs(v - mean) / mean for v in values)


def check_bursts_spread(
    cluster: Cluster,
    router: Router,
    rng: random.Random,
    place: Callable[[int, int], Placement],
    requests: int = 64,
) -> None:
    """``requests`` mixed requests (``place(prompt_len, max_tokens)`` queues each), arriving
    in bursts between two engine steps (two table updates): at the end every prefill
    worker's prompt tokens and every decode worker's tokens are within 25 % of the mean."""
    prefill_load: dict[int, int] = defaultdict(int)
    decode_load: dict[int, int] = defaultdict(int)
    placed = 0
    while placed < requests:
        for _ in range(min(rng.randint(1, 12), requests - placed)):
            prompt_len, max_tokens = mixed_request(rng)
            p = place(prompt_len, max_tokens)
            prefill_load[p.prefill] += prompt_len
            decode_load[p.decode] += prompt_len + max_tokens
            placed += 1
        cluster.step(router)
    assert spread(prefill_load, len(cluster.prefills)) <= 0.25, dict(prefill_load)
    assert spread(decode_load, len(cluster.decodes)) <= 0.25, dict(decode_load)
