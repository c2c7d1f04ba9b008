"""The router's books: what it has sent to each worker, and what each has taken.

The load table says what a worker reports; between two reports the router alone knows
what it has sent since. Per worker generation (a restart starts new books):
    sent_requests, sent_tokens   cumulative, comparable with the row's requests_received /
                                 prompt_tokens_received: the difference is still on the ring
    reserved                     decode targets: ticket -> KV tokens (prompt + max_tokens)
                                 of requests placed and not yet released, oldest first
Per (role, index), across restarts: ``Assigned`` (requests, tokens) for ``/metrics``.

Several frontends (``launch --api-workers N``) each run a router over the same workers.
The table's cumulative counters then include every frontend's requests, so each router
must also know what the others have in flight, or each would admit up to the bound by
itself. ``PeerBooks`` is that: every router publishes its books per worker slot into
memory all frontends share (``frontend/engine_link/board.py``) and reads the others'
sums (``InFlight``) with each table snapshot. Books then count from the start of the
worker's generation, not from what it had received when this router first saw it: the
sum over routers is what the worker will have received.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from transport.load_table import LoadRow
from wire.roles import Role

WorkerKey = tuple[Role, int]


@dataclass(frozen=True)
class InFlight:
    """What the other frontends' routers have sent to one worker generation, and reserved
    on it (decode: requests placed and not released, and their KV tokens)."""

    sent_requests: int = 0
    sent_tokens: int = 0
    reserved_requests: int = 0
    reserved_tokens: int = 0


@dataclass(frozen=True)
class Cell:
    """One router's published books for one worker slot."""

    generation: int
    sent_requests: int
    sent_tokens: int
    reserved_requests: int
    reserved_tokens: int
    assigned_requests: int
    assigned_tokens: int


class PeerBooks(Protocol):
    """The books of every frontend's router, by worker slot, in shared memory."""

    def own(self, slot: int) -> Cell | None:
        """What this frontend published last for ``slot`` (a restarted frontend goes on
        from its predecessor's figures); None if nothing."""

    def others(self, slot: int, generation: int) -> InFlight:
        """The other live frontends' sums for that worker generation."""

    def publish(self, slot: int, cell: Cell) -> None: ...

    def assigned(self, slot: int) -> tuple[int, int]:
        """(requests, tokens) every frontend has assigned to ``slot``, summed."""


@dataclass
class Books:
    """One worker generation's accounts (router-private, mutable); ``others`` is what the
    other frontends have in flight there, as of the last snapshot."""

    generation: int
    sent_requests: int = 0
    sent_tokens: int = 0
    reserved: dict[int, int] = field(default_factory=dict)
    slot: int = -1
    others: InFlight = InFlight()

    def unsent_tokens(self, r: LoadRow) -> int:
        """Prompt tokens sent that the worker has not taken off its ring yet (exact: FIFO)."""
        return max(0, self.sent_tokens + self.others.sent_tokens - r.prompt_tokens_received)

    def unreported_requests(self, r: LoadRow) -> int:
        if r.role is Role.DECODE:
            return max(0, self.num_reserved - r.running_requests - r.waiting_requests)
        return max(0, self.sent_requests + self.others.sent_requests - r.requests_received)

    @property
    def num_reserved(self) -> int:
        return len(self.reserved) + self.others.reserved_requests

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reserved.values()) + self.others.reserved_tokens

    def unheld_reserved(self, r: LoadRow) -> int:
        """KV tokens reserved for assignments decode does not hold yet, taken to be the
        newest (requests reach decode from several prefill workers in any order): this
        router's own, then the others' at their mean size."""
        unheld = max(0, self.num_reserved - r.running_requests - r.waiting_requests)
        own = sum(itertools.islice(reversed(self.reserved.values()), unheld))
        rest = unheld - min(unheld, len(self.reserved))
        o = self.others
        return own + (rest * o.reserved_tokens // o.reserved_requests if rest else 0)


@dataclass
class Assigned:
    requests: int = 0
    tokens: int = 0  # prompt for prefill, prompt + max_tokens for decode, both co-located


class Ledger:
    def __init__(self, peers: PeerBooks | None = None) -> None:
        self.books: dict[WorkerKey, Books] = {}
        self.assigned: defaultdict[WorkerKey, Assigned] = defaultdict(Assigned)
        self.peers = peers

    def sync(self, rows: list[LoadRow]) -> None:
        """Open books for every worker generation seen for the first time; with peers,
        read what the other frontends have in flight on every worker."""
        for r in rows:
            if r.role is None:
                continue
            b = self.books.get((r.role, r.index))
            if b is None or b.generation != r.generation:
                b = self.books[(r.role, r.index)] = self._open(r)
            if self.peers is not None:
                b.others = self.peers.others(r.slot, r.generation)

    def _open(self, r: LoadRow) -> Books:
        if self.peers is None:
            # Baseline at what the worker already reports, so a router that starts
            # after the workers does not count their history as in flight.
            return Books(r.generation, r.requests_received, r.prompt_tokens_received, slot=r.slot)
        mine = self.peers.own(r.slot)
        if mine is not None and r.worker not in self.assigned:
            self.assigned[r.worker] = Assigned(mine.assigned_requests, mine.assigned_tokens)
        if mine is not None and mine.generation == r.generation:
            # A predecessor of this frontend sent these: they are in what r received.
            return Books(r.generation, mine.sent_requests, mine.sent_tokens, slot=r.slot)
        return Books(r.generation, slot=r.slot)

    def publish(self, key: WorkerKey) -> None:
        """Show the other frontends this router's books for ``key`` (no-op without peers)."""
        b = self.books.get(key)
        if self.peers is None or b is None:
            return
        a = self.assigned[key]
        self.peers.publish(
            b.slot,
            Cell(
                b.generation,
                b.sent_requests,
                b.sent_tokens,
                len(b.reserved),
                sum(b.reserved.values()),
                a.requests,
                a.tokens,
            ),
        )

    def of(self, r: LoadRow) -> Books:
        return self.books[r.worker]

    def current(self, key: WorkerKey, generation: int) -> Books | None:
        """The books of ``key`` if it is still that generation (else a restart voided them)."""
        b = self.books.get(key)
        return b if b is not None and b.generation == generation else None

    def in_flight(self) -> int:
        """Requests placed and not yet released."""
        return sum(len(b.reserved) for b in self.books.values())

    def count(self, key: WorkerKey, tokens: int, requests: int = 1) -> None:
        a = self.assigned[key]
        a.requests += requests
        a.tokens += tokens
