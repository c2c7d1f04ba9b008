"""The router's books: what it has sent to each worker, and what each has taken.

The load table says what a worker reports; between two reports the router alone knows
what it has sent since. Per worker generation (a restart starts new books):
    sent_requests, sent_tokens   cumulative, comparable with the row's requests_received /
                                 prompt_tokens_received: the difference is still on the ring
    reserved                     decode targets: ticket -> KV tokens (prompt + max_tokens)
                                 of requests placed and not yet released, oldest first
Per (role, index), across restarts: ``Assigned`` (requests, tokens) for ``/metrics``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from transport.load_table import LoadRow, Role

WorkerKey = tuple[Role, int]


@dataclass
class Books:
    """One worker generation's accounts (router-private, mutable)."""

    generation: int
    sent_requests: int = 0
    sent_tokens: int = 0
    reserved: dict[int, int] = field(default_factory=dict)

    def unsent_tokens(self, r: LoadRow) -> int:
        """Prompt tokens sent that the worker has not taken off its ring yet (exact: FIFO)."""
        return max(0, self.sent_tokens - r.prompt_tokens_received)

    def unreported_requests(self, r: LoadRow) -> int:
        if r.role is Role.DECODE:
            return max(0, len(self.reserved) - r.running_requests - r.waiting_requests)
        return max(0, self.sent_requests - r.requests_received)

    def unheld_reserved(self, r: LoadRow) -> int:
        """KV tokens reserved for assignments decode does not hold yet, taken to be the
        newest (requests reach decode from several prefill workers in any order)."""
        unheld = max(0, len(self.reserved) - r.running_requests - r.waiting_requests)
        return sum(itertools.islice(reversed(self.reserved.values()), unheld))


@dataclass
class Assigned:
    requests: int = 0
    tokens: int = 0  # prompt for prefill, prompt + max_tokens for decode, both co-located


class Ledger:
    def __init__(self) -> None:
        self.books: dict[WorkerKey, Books] = {}
        self.assigned: defaultdict[WorkerKey, Assigned] = defaultdict(Assigned)

    def sync(self, rows: list[LoadRow]) -> None:
        """Open books for every worker generation seen for the first time."""
        for r in rows:
            if r.role is Role.NONE:
                continue
            b = self.books.get((r.role, r.index))
            if b is None or b.generation != r.generation:
                # Baseline at what the worker already reports, so a router that starts
                # after the workers does not count their history as in flight.
                self.books[(r.role, r.index)] = Books(
                    r.generation, r.requests_received, r.prompt_tokens_received
                )

    def of(self, r: LoadRow) -> Books:
        return self.books[(r.role, r.index)]

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
