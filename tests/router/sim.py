"""Simulated workers that report into a real load table the way the engines will.

A prefill worker drains its FIFO request ring at each step, prefills ``chunk`` tokens of
its queue per step, and hands finished prompts to their decode worker. A decode worker
admits transfers while it has KV blocks, grows each running request by one token per step
and finishes it after ``max_tokens`` outputs, releasing the placement as the frontend would.
"""

from __future__ import annotations

import math
import os
import random
from collections import deque
from dataclasses import dataclass, field

from router.router import Placement, Router
from transport.load_table import LoadTable, Role, RowWriter, WorkerState


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

    def step(self, decoders: list[SimDecode]) -> None:
        while self.ring:
            p = self.ring.popleft()
            self.received += 1
            self.tokens_received += p.prompt_len
            self.queue.append(_Job(p, p.prompt_len))
        budget = self.chunk
        while self.queue and budget > 0:
            job = self.queue[0]
            done = min(budget, job.left)
            job.left -= done
            budget -= done
            if job.left == 0:
                self.queue.popleft()
                decoders[job.placement.decode].ring.append(job.placement)
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

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def used(self) -> int:
        return sum(self.blocks(j.kv_len) for j in self.running)

    def step(self, router: Router) -> None:
        while self.ring:
            p = self.ring[0]
            if self.used() + self.blocks(p.prompt_len + 1) > self.total_blocks:
                break
            self.ring.popleft()
            self.running.append(_Job(p, left=p.max_tokens - 1, kv_len=p.prompt_len + 1))
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

    def step(self, router: Router) -> None:
        for p in self.prefills:
            p.step(self.decodes)
        for d in self.decodes:
            d.step(router)


def start_cluster(
    buf: bytearray, n_prefill: int, n_decode: int, total_blocks: int = 8192
) -> Cluster:
    """Claim one row per worker (all owned by this live process) and mark them READY."""
    table = LoadTable(buf, n_prefill + n_decode)
    prefills: list[SimPrefill] = []
    decodes: list[SimDecode] = []
    for i in range(n_prefill):
        w = table.writer(i)
        w.claim(Role.PREFILL, i, pid=os.getpid())
        prefills.append(SimPrefill(w))
    for j in range(n_decode):
        w = table.writer(n_prefill + j)
        w.claim(Role.DECODE, j, pid=os.getpid(), block_size=16)
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
