"""The role table: what each ``launch --workers`` engine worker serves as now.

A ``--workers`` worker is one process kind (``colocated.worker``) that can prefill and
hand its KV off, adopt another's handoff and decode, or do both for its own requests.
Which of those the router sends it is its role, kept here in shared memory:
    ``Role.COLOCATED``  takes new requests and serves them end to end
    ``Role.PREFILL``    takes new requests, prefills them, hands the KV to a decoder
    ``Role.DECODE``     takes handoffs (and the requests placed whole on it, see
                        ``router/roles.py``); no other new prefills
A role steers placement only: a worker whose role changes keeps running what it holds
(its decode rows finish where they are), so a change restarts nothing, reloads nothing
and loses nothing.

The start (``start_roles``): every worker COLOCATED, the planner's level 0. (Starting
with one co-located worker and the others idle was measured and lost: with chat at 1
req/s and a 50 ms TPOT target one co-located worker met it for 82 % of requests, two for
100 %, benchmarks/results/goodput.md.)

Who does what:
    launcher    creates the segment (``layout_nbytes``), ``format``s it with the start
                roles; hands it to every frontend (``segments["roles"]``)
    frontend 0  its planner (``router/planner.py``) or the test route sets roles (``set``);
                the planner reads every frontend's finished requests (``samples_since``)
    frontends   read the roles before each placement (``roles``), count their placements
                by kind in their own row (``count``), and show both in /health, /metrics;
                each writes its finished requests' TTFT and TPOT to its own ring
                (``add_sample``), so the planner judges all the traffic, not frontend 0's

Layout: a 64-byte header (magic, num_workers, num_frontends, set by hand), then per worker 8 int64
words (role code, changes, monotonic ns of the last change, ns spent as prefill /
decode / co-located before it), then per frontend 8 int64 words (placements by kind), then per frontend a sample ring:
one int64 count of samples written, then ``SAMPLES`` x 3 float64 (arrival on the host's
monotonic clock, TTFT, TPOT or NaN; seconds).
NOTE: every word has one writer and is an aligned 8-byte store, never torn; a reader
may see one word of a row newer than another, which only the /metrics figures can show,
for one scrape. Placement reads the role word alone. A ring's writer stores a sample,
then its count; its reader reads the count, the samples, then the count again, and keeps
only samples the writer cannot have lapped meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from wire.roles import Role

_MAGIC = 0x7064_726F_6C65_7362  # "pdrolesb"
_HEADER_WORDS = 8
_ROW_WORDS = 8
_BY_HAND = 3  # header word: roles set by hand, no planner
_ROLE, _CHANGES, _SINCE = 0, 1, 2
_TIME_AT = {Role.PREFILL: 3, Role.DECODE: 4, Role.COLOCATED: 5}
SERVING_ROLES = tuple(_TIME_AT)
# What a request's placement was (``count``, /metrics ``pdserve_placements``):
#   handoff    prefilled on a PREFILL worker, KV handed to another worker to decode
#   local      placed whole on a DECODE worker (per-request placement: no handoff)
#   colocated  placed whole on a COLOCATED worker
PLACEMENT_KINDS = ("handoff", "local", "colocated")
SAMPLES = 256  # per frontend: more finished requests than a planner step (1 s) sees
_RING_WORDS = 1 + 3 * SAMPLES


def start_roles(num_workers: int) -> list[Role]:
    """The roles workers start in: every one co-located."""
    return [Role.COLOCATED] * num_workers


class RoleTableError(ValueError):
    """The buffer does not hold a role table of the expected shape."""


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """One worker's role now, how often it changed and the seconds spent in each role."""

    index: int
    role: Role
    changes: int
    seconds: dict[Role, float]


class RoleTable:
    """A view of the role table over ``buf`` (writable; kept mapped by the caller)."""

    @staticmethod
    def layout_nbytes(num_workers: int, num_frontends: int) -> int:
        rows = _ROW_WORDS * (num_workers + num_frontends)
        return 8 * (_HEADER_WORDS + rows + _RING_WORDS * num_frontends)

    @classmethod
    def format(cls, buf: Any, num_workers: int, num_frontends: int) -> RoleTable:
        """Write the header and give the workers their ``start_roles`` (the launcher)."""
        words = np.frombuffer(buf, np.int64)
        words[:] = 0
        words[:3] = (_MAGIC, num_workers, num_frontends)
        table = cls(buf)
        now = time.monotonic_ns()
        for i, role in enumerate(start_roles(num_workers)):
            row = table._row(i)
            row[_ROLE], row[_SINCE] = role.table_code, now
        return table

    def __init__(self, buf: Any) -> None:
        words = np.frombuffer(buf, np.int64)
        if len(words) < _HEADER_WORDS or int(words[0]) != _MAGIC:
            raise RoleTableError("not a role table")
        self.num_workers, self.num_frontends = int(words[1]), int(words[2])
        need = self.layout_nbytes(self.num_workers, self.num_frontends) // 8
        if len(words) < need:
            raise RoleTableError(f"role table of {len(words)} words, {need} needed")
        self._words = words
        self._floats = np.frombuffer(buf, np.float64)  # the sample rings' view

    @property
    def by_hand(self) -> bool:
        """Were the roles set by hand (POST /roles)? The planner then keeps off."""
        return bool(self._words[_BY_HAND])

    def mark_by_hand(self) -> None:
        self._words[_BY_HAND] = 1

    def _row(self, i: int) -> np.ndarray:
        start = _HEADER_WORDS + _ROW_WORDS * i
        return self._words[start : start + _ROW_WORDS]

    def role(self, index: int) -> Role:
        code = int(self._row(index)[_ROLE])
        role = Role.from_table_code(code)
        if role not in _TIME_AT:
            raise RoleTableError(f"worker {index} holds no serving role (code {code})")
        assert role is not None
        return role

    def roles(self) -> list[Role]:
        """Every worker's role, by worker index."""
        return [self.role(i) for i in range(self.num_workers)]

    def set(self, index: int, role: Role) -> bool:
        """Make ``role`` worker ``index``'s (the single writer: frontend 0); False if it
        was already its role."""
        if role not in _TIME_AT:
            raise ValueError(f"{role} is not a serving role")
        row = self._row(index)
        old = self.role(index)
        if old is role:
            return False
        now = time.monotonic_ns()
        row[_TIME_AT[old]] += now - int(row[_SINCE])
        row[_SINCE] = now
        row[_CHANGES] += 1
        row[_ROLE] = role.table_code  # last: a reader routing by it sees the change whole
        return True

    def report(self) -> list[WorkerRole]:
        """Every worker's role, changes and seconds in each role (up to now)."""
        now = time.monotonic_ns()
        out = []
        for i in range(self.num_workers):
            row = self._row(i).copy()
            role = self.role(i)
            ns = {r: int(row[at]) for r, at in _TIME_AT.items()}
            ns[role] += max(0, now - int(row[_SINCE]))
            seconds = {r: v / 1e9 for r, v in ns.items()}
            out.append(WorkerRole(i, role, int(row[_CHANGES]), seconds))
        return out

    def count(self, frontend: int, kind: str) -> None:
        """One more placement of ``kind`` (``PLACEMENT_KINDS``) by ``frontend``."""
        self._row(self.num_workers + frontend)[PLACEMENT_KINDS.index(kind)] += 1

    def placements(self) -> dict[str, int]:
        """Placements by kind, every frontend's summed."""
        rows = [self._row(self.num_workers + f) for f in range(self.num_frontends)]
        return {k: sum(int(r[i]) for r in rows) for i, k in enumerate(PLACEMENT_KINDS)}

    def _ring_at(self, frontend: int) -> int:
        return (
            _HEADER_WORDS
            + _ROW_WORDS * (self.num_workers + self.num_frontends)
            + (_RING_WORDS * frontend)
        )

    def sample_count(self, frontend: int) -> int:
        """How many samples ``frontend`` has written."""
        return int(self._words[self._ring_at(frontend)])

    def add_sample(self, frontend: int, arrived: float, ttft: float, tpot: float | None) -> None:
        """A request ``frontend`` saw finish (its single writer)."""
        at = self._ring_at(frontend)
        written = int(self._words[at])
        row = at + 1 + 3 * (written % SAMPLES)
        self._floats[row : row + 3] = (arrived, ttft, np.nan if tpot is None else tpot)
        self._words[at] = written + 1  # last: the reader takes samples below the count

    def samples_since(
        self, frontend: int, seen: int
    ) -> tuple[list[tuple[float, float, float | None]], int]:
        """``frontend``'s samples after the first ``seen`` it wrote, oldest first (those
        it wrote over are gone), and the count to pass next time."""
        at = self._ring_at(frontend)
        written = int(self._words[at])
        first = max(seen, written - SAMPLES)
        ring = self._floats[at + 1 : at + 1 + 3 * SAMPLES].reshape(SAMPLES, 3)
        rows = ring[np.arange(first, written) % SAMPLES]  # (n, 3), a copy
        # The writer may have gone on meanwhile: the slot of a sample it is storing now
        # (its count not yet raised) is lost too.
        kept = rows[max(0, int(self._words[at]) - SAMPLES + 1 - first) :]
        out = [(a, t, None if np.isnan(p) else p) for a, t, p in kept.tolist()]
        return out, written
