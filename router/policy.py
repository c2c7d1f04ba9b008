"""Placement policies and the router that applies them to load-table snapshots.

The router runs in the frontend, single-threaded (the event loop): ``place`` picks a
(prefill, decode) pair for a new request, ``release`` is called once when it ends.

Load is measured in tokens:
  prefill i   queued_prefill_tokens (reported) + prompt tokens the router sent that the
              worker has not taken off its ring yet (cumulative sent - cumulative received;
              the ring is FIFO and every sent request is eventually received, so this is
              exact, not a time-window guess).
  decode j    KV tokens the worker's requests will need until they finish. The router's
              own books give that: prompt_len + max_tokens for each request it assigned to
              j and has not released (early finishes come back through ``release``). The
              table gives what j really holds: (total - free) * block_size, plus those
              reservations for the assignments j does not hold yet (counted as active -
              running - waiting; requests reach decode from several prefill workers in any
              order, so the newest assignments are taken to be the unheld ones). The cost
              is the larger of the two views, so KV the router does not know of (work from
              before a frontend restart) still counts.
A colocated worker's load is the sum of both.
"""

from __future__ import annotations

import enum
import itertools
import os
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transport.load_table import LoadRow, LoadTable, Role, WorkerState


class PolicyName(enum.StrEnum):
    LEAST_LOAD = "least-load"
    POWER_OF_TWO = "power-of-two"
    ROUND_ROBIN = "round-robin"


class NoCapacity(Exception):
    """No worker can take the request now; the frontend answers 503 + Retry-After."""

    def __init__(self, retry_after_s: float, reason: str) -> None:
        super().__init__(f"no capacity ({reason}); retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(frozen=True)
class RouterConfig:
    """Admission bounds are per worker; None disables one (not recommended in production)."""

    stale_after_s: float = 1.0  # a row whose heartbeat is older than this is not routable
    max_waiting_requests: int | None = 1024
    max_queued_prefill_tokens: int | None = 262_144
    retry_after_s: float = 1.0  # when workers are busy
    retry_after_dead_s: float = 5.0  # when no worker of a role is alive (a restart takes a while)
    seed: int | None = None  # power-of-two sampling; None draws from the OS


@dataclass(frozen=True)
class Placement:
    """Where a request runs: role indices (as carried in request records), not table slots."""

    prefill: int
    decode: int
    ticket: int = 0
    prompt_len: int = 0
    max_tokens: int = 0
    prefill_generation: int = 0
    decode_generation: int = 0


@dataclass(frozen=True)
class Candidate:
    index: int
    cost: int
    # Tokens assigned to this worker so far: breaks ties between equally loaded workers,
    # so that at low load (every queue empty, every cost 0) work still alternates.
    assigned: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        return self.cost, self.assigned, self.index


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        """Pick one of a non-empty list of routable workers, sorted by index."""
        ...


class LeastLoad:
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return min(candidates, key=_key)


class PowerOfTwo:
    """Cost of two random candidates, keep the cheaper: near least-load, no herd on stale data."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return min((a, b), key=_key)


class RoundRobin:
    """The next routable index after the previous choice, cyclically; ignores cost."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        after = [c for c in candidates if c.index >= self._next]
        pick = after[0] if after else candidates[0]
        self._next = pick.index + 1
        return pick


def make_policy(name: PolicyName | str, seed: int | None = None) -> Policy:
    name = PolicyName(name)
    if name is PolicyName.LEAST_LOAD:
        return LeastLoad()
    if name is PolicyName.POWER_OF_TWO:
        return PowerOfTwo(seed)
    return RoundRobin()


@dataclass
class _Tracked:
    """The router's own view of one worker generation (mutable, router-private)."""

    generation: int
    sent_requests: int = 0  # cumulative, comparable with the row's requests_received
    sent_tokens: int = 0  # cumulative, comparable with prompt_tokens_received
    # Requests assigned to this worker as a decode target and not released:
    # ticket -> KV tokens reserved (prompt_len + max_tokens), in assignment order.
    active: dict[int, int] = field(default_factory=dict)


class Router:
    def __init__(
        self,
        table: LoadTable,
        policy: PolicyName | str = PolicyName.LEAST_LOAD,
        config: RouterConfig | None = None,
    ) -> None:
        self._table = table
        self._config = config or RouterConfig()
        seeds = (
            (None, None) if self._config.seed is None else (self._config.seed, ~self._config.seed)
        )
        self._prefill_policy = make_policy(policy, seeds[0])
        self._decode_policy = make_policy(policy, seeds[1])
        self._tracked: dict[tuple[Role, int], _Tracked] = {}
        self._tickets = itertools.count(1)
        # Per (role, index), across restarts: [requests, tokens] assigned. Tokens are prompt
        # tokens for a prefill worker, prompt + max_tokens (the KV it reserves) for a decode
        # worker, both for a colocated one.
        self._assigned: defaultdict[tuple[Role, int], list[int]] = defaultdict(lambda: [0, 0])

    def place(self, prompt_len: int, max_tokens: int) -> Placement:
        """Choose the workers for a request, or raise ``NoCapacity``.

        The placement is counted as in flight until ``release``; the caller must send it
        to the chosen prefill worker (or call ``release(p, delivered=False)``).
        """
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(
                f"prompt_len and max_tokens must be >= 1, got {prompt_len}, {max_tokens}"
            )
        rows = self._sync(self._table.snapshot())
        now = time.monotonic_ns()
        colocated = [r for r in rows if r.role is Role.COLOCATED]
        if colocated:
            pick, worker = self._choose(colocated, Role.COLOCATED, prompt_len, now)
            return self._commit(worker, worker, pick, pick, prompt_len, max_tokens)
        p_rows = [r for r in rows if r.role is Role.PREFILL]
        d_rows = [r for r in rows if r.role is Role.DECODE]
        p_pick, p_worker = self._choose(p_rows, Role.PREFILL, prompt_len, now)
        d_pick, d_worker = self._choose(d_rows, Role.DECODE, prompt_len, now)
        return self._commit(p_worker, d_worker, p_pick, d_pick, prompt_len, max_tokens)

    def check_capacity(self) -> None:
        """Raise ``NoCapacity`` when ``place`` would refuse every request, however small.

        Cheap and commits nothing: the frontend asks before it parses and tokenizes a
        body, so a request burst beyond the admission bound is refused at a fraction of
        the cost of a full placement. ``place`` still decides for the requests it lets by.
        (Admission only gets harder as the prompt grows, so a 1-token prompt is the test.)
        """
        rows = self._sync(self._table.snapshot())
        now = time.monotonic_ns()
        roles = {r.role for r in rows}
        for role in (Role.COLOCATED,) if Role.COLOCATED in roles else (Role.PREFILL, Role.DECODE):
            self._choose([r for r in rows if r.role is role], role, 1, now)

    def release(self, placement: Placement, delivered: bool = True) -> None:
        """The request ended (any reason). ``delivered=False``: it was never sent to prefill.

        Releases of a worker generation that has since restarted are ignored: the new
        generation's accounting never included them.
        """
        p_role, d_role = self._roles(placement)
        decode = self._tracked.get((d_role, placement.decode))
        if decode is not None and decode.generation == placement.decode_generation:
            decode.active.pop(placement.ticket, None)
        prefill = self._tracked.get((p_role, placement.prefill))
        if (
            not delivered
            and prefill is not None
            and prefill.generation == placement.prefill_generation
        ):
            prefill.sent_requests -= 1
            prefill.sent_tokens -= placement.prompt_len
        if not delivered:  # nobody worked on it: it was never assigned after all
            kv = placement.prompt_len + placement.max_tokens
            if p_role is Role.COLOCATED:
                self._count((p_role, placement.prefill), -kv, -1)
            else:
                self._count((p_role, placement.prefill), -placement.prompt_len, -1)
                self._count((d_role, placement.decode), -kv, -1)

    def assigned(self) -> dict[tuple[Role, int], tuple[int, int]]:
        """(requests, tokens) assigned per (role, index) since the router started."""
        return {key: (n, tokens) for key, (n, tokens) in self._assigned.items()}

    def in_flight(self) -> int:
        """Requests placed and not yet released (for /metrics)."""
        return sum(len(t.active) for t in self._tracked.values())

    # -- internals ---------------------------------------------------------------------

    def _roles(self, placement: Placement) -> tuple[Role, Role]:
        colocated = any(role is Role.COLOCATED for role, _ in self._tracked)
        return (Role.COLOCATED, Role.COLOCATED) if colocated else (Role.PREFILL, Role.DECODE)

    def _sync(self, rows: list[LoadRow]) -> list[LoadRow]:
        """Start fresh accounting for every worker generation seen for the first time."""
        for r in rows:
            if r.role is Role.NONE:
                continue
            t = self._tracked.get((r.role, r.index))
            if t is None or t.generation != r.generation:
                # Baseline at what the worker already reports, so a router that starts
                # after the workers does not count their history as in flight.
                self._tracked[(r.role, r.index)] = _Tracked(
                    r.generation, r.requests_received, r.prompt_tokens_received
                )
        return rows

    def _choose(
        self, rows: list[LoadRow], role: Role, prompt_len: int, now_ns: int
    ) -> tuple[int, LoadRow]:
        live = [r for r in rows if self._routable(r, now_ns)]
        if not live:
            raise NoCapacity(self._config.retry_after_dead_s, f"no live {role.name.lower()} worker")
        admitted = [r for r in live if self._admits(r, prompt_len)]
        if not admitted:
            raise NoCapacity(
                self._config.retry_after_s, f"every {role.name.lower()} worker is full"
            )
        by_index = {r.index: r for r in admitted}
        candidates = [
            Candidate(r.index, self._cost(r), self._assigned[(r.role, r.index)][1])
            for r in sorted(admitted, key=_index)
        ]
        policy = self._decode_policy if role is Role.DECODE else self._prefill_policy
        pick = policy.choose(candidates).index
        return pick, by_index[pick]

    def _routable(self, r: LoadRow, now_ns: int) -> bool:
        if r.state is not WorkerState.READY or r.pid <= 0:
            return False
        if now_ns - r.heartbeat_ns > self._config.stale_after_s * 1e9:
            return False
        return _pid_alive(r.pid)

    def _admits(self, r: LoadRow, prompt_len: int) -> bool:
        cfg, t = self._config, self._tracked[(r.role, r.index)]
        waiting = r.waiting_requests + self._unreported_requests(r, t)
        if cfg.max_waiting_requests is not None and waiting >= cfg.max_waiting_requests:
            return False
        if r.role is Role.DECODE or cfg.max_queued_prefill_tokens is None:
            return True
        queued = r.queued_prefill_tokens + max(0, t.sent_tokens - r.prompt_tokens_received)
        # An idle worker takes any prompt, however long: the bound limits queues, not prompts.
        return queued == 0 or queued + prompt_len <= cfg.max_queued_prefill_tokens

    def _unreported_requests(self, r: LoadRow, t: _Tracked) -> int:
        if r.role is Role.DECODE:
            return max(0, len(t.active) - r.running_requests - r.waiting_requests)
        return max(0, t.sent_requests - r.requests_received)

    def _cost(self, r: LoadRow) -> int:
        t = self._tracked[(r.role, r.index)]
        prefill = r.queued_prefill_tokens + max(0, t.sent_tokens - r.prompt_tokens_received)
        if r.role is Role.PREFILL:
            return prefill
        used = (r.total_kv_blocks - r.free_kv_blocks) * r.block_size
        held = r.running_requests + r.waiting_requests
        unheld = max(0, len(t.active) - held)
        unheld_reserved = sum(itertools.islice(reversed(t.active.values()), unheld))
        decode = max(used + unheld_reserved, sum(t.active.values()))
        return decode if r.role is Role.DECODE else decode + prefill

    def _commit(
        self,
        p_worker: LoadRow,
        d_worker: LoadRow,
        p_pick: int,
        d_pick: int,
        prompt_len: int,
        max_tokens: int,
    ) -> Placement:
        ticket = next(self._tickets)
        p = self._tracked[(p_worker.role, p_pick)]
        p.sent_requests += 1
        p.sent_tokens += prompt_len
        self._tracked[(d_worker.role, d_pick)].active[ticket] = prompt_len + max_tokens
        p_key, d_key = (p_worker.role, p_pick), (d_worker.role, d_pick)
        if p_key == d_key:  # colocated: one worker does both halves
            self._count(p_key, prompt_len + max_tokens)
        else:
            self._count(p_key, prompt_len)
            self._count(d_key, prompt_len + max_tokens)
        return Placement(
            prefill=p_pick,
            decode=d_pick,
            ticket=ticket,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            prefill_generation=p_worker.generation,
            decode_generation=d_worker.generation,
        )

    def _count(self, key: tuple[Role, int], tokens: int, requests: int = 1) -> None:
        self._assigned[key][0] += requests
        self._assigned[key][1] += tokens


def _index(r: LoadRow) -> int:
    return r.index


def _key(c: Candidate) -> tuple[int, int, int]:
    return c.key


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True
