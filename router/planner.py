"""The planner: sets the roles of ``launch --workers N`` against TTFT and TPOT targets.

It runs in frontend 0, beside its router, once every ``interval_s``. The roles it sets
form a ladder of N levels, each one worker apart:
    level 0       every worker COLOCATED (prefills and decodes its own requests; the
                  start, ``transport/role_table.start_roles``)
    level L >= 1  workers 0 .. N-L-1 PREFILL, workers N-L .. N-1 DECODE
Co-located serving gets the most out of a host (every worker prefills, no copy), but
each prefill chunk stalls the decode rows beside it; a split keeps decode steps free of
prefill (TPOT) at the cost of prefill capacity (TTFT: on a CPU host a prompt gets the
cores the decoders leave, ``transport/core_lease.py``). So:
    TPOT over its target (and further over than TTFT)   -> one level up (decode isolated)
    TTFT over its target (and further over than TPOT)   -> one level down (more prefill)
judged on the ``quantile`` of the requests that arrived since the last change (at least
``min_samples`` of them, none older than ``window_s`` unless fewer arrived in it: long
requests at a low rate), and TTFT also on what the load table shows: the prompt tokens
queued on the workers that take new requests, over their measured prefill rate, is a
lower bound of the next request's TTFT.

No flapping: a level holds at least ``dwell_s``, and only samples of requests that
arrived under it judge it. A role change restarts nothing (``transport/role_table.py``):
workers keep what they hold; only new placements follow the roles.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from transport.load_table import LoadRow, WorkerState
from transport.role_table import RoleTable, start_roles
from wire.roles import Role

logger = logging.getLogger(__name__)

# Targets by device when the launch names none: on a 2-core CPU a 256-token prefill of
# the default model takes ~0.3 s alone and a decode step ~20-60 ms at 8-32 rows.
DEFAULT_SLO_MS = {"cpu": (2000.0, 100.0), "cuda": (500.0, 50.0)}


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_s: float
    slo_tpot_s: float
    interval_s: float = 1.0
    dwell_s: float = 10.0  # a level holds at least this long
    window_s: float = 30.0  # samples older than this count only to make up min_samples
    min_samples: int = 8
    quantile: float = 0.9


@dataclass(frozen=True)
class Sample:
    """One finished request: when it arrived (monotonic s), its TTFT and TPOT (s)."""

    arrived: float
    ttft: float
    tpot: float | None  # None: one output token


def level_roles(level: int, n: int) -> list[Role]:
    """The roles of ladder ``level`` for ``n`` workers (see the module docstring)."""
    assert 0 <= level < max(n, 1), (level, n)
    if level == 0:
        return start_roles(n)
    return [Role.PREFILL] * (n - level) + [Role.DECODE] * level


def level_of(roles: Sequence[Role]) -> int | None:
    """The ladder level ``roles`` are, None if they are none (set by hand)."""
    n = len(roles)
    for level in range(max(n, 1)):
        if list(roles) == level_roles(level, n):
            return level
    return None


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def queue_ttft(rows: Sequence[LoadRow], roles: Sequence[Role], rate: float) -> float:
    """Seconds the prompt tokens queued on the workers that take new requests need, at
    ``rate`` prompt tokens/s per worker: what a request arriving now waits at least."""
    takers = [
        r
        for r in rows
        if r.state is WorkerState.READY
        and r.index < len(roles)
        and roles[r.index] is not Role.DECODE
    ]
    if not takers or rate <= 0:
        return 0.0
    return sum(r.queued_prefill_tokens for r in takers) / len(takers) / rate


def decide(
    level: int, n: int, ttft: float, tpot: float | None, config: PlannerConfig
) -> tuple[int, str]:
    """The next level from the current one and the observed TTFT/TPOT (seconds, at the
    configured quantile), with the reason in words ("" when it stays)."""
    r_ttft = ttft / config.slo_ttft_s
    r_tpot = 0.0 if tpot is None else tpot / config.slo_tpot_s
    if tpot is not None and r_tpot > 1 and r_tpot >= r_ttft and level < n - 1:
        return (
            level + 1,
            f"TPOT {tpot * 1e3:.0f} ms over its {config.slo_tpot_s * 1e3:.0f} ms target",
        )
    if r_ttft > 1 and r_ttft > r_tpot and level > 0:
        return (
            level - 1,
            f"TTFT {ttft * 1e3:.0f} ms over its {config.slo_ttft_s * 1e3:.0f} ms target",
        )
    return level, ""


class Planner:
    """The planner of one server; ``step`` is called every ``config.interval_s``."""

    def __init__(self, table: RoleTable, config: PlannerConfig) -> None:
        self.table = table
        self.config = config
        self.samples: deque[Sample] = deque(maxlen=4096)
        self.changed_at = time.monotonic()
        self._rate = _PrefillRate()

    def observe(self, sample: Sample) -> None:
        self.samples.append(sample)

    def step(self, rows: Sequence[LoadRow], now: float | None = None) -> bool:
        """Move one level if the targets say so; True if the roles changed."""
        now = time.monotonic() if now is None else now
        self._rate.update(rows, now)
        if self.table.by_hand or now - self.changed_at < self.config.dwell_s:
            return False
        roles = self.table.roles()
        level = level_of(roles)
        if level is None:
            return False
        fresh = self._judges(now)
        if not fresh:
            return False
        q = self.config.quantile
        ttft = max(quantile([s.ttft for s in fresh], q), queue_ttft(rows, roles, self._rate.rate))
        tpots = [s.tpot for s in fresh if s.tpot is not None]
        tpot = quantile(tpots, q) if tpots else None
        new, why = decide(level, len(roles), ttft, tpot, self.config)
        if new == level:
            return False
        self.apply(level_roles(new, len(roles)), why)
        self.changed_at = now
        return True

    def _judges(self, now: float) -> list[Sample]:
        """The samples that judge the current level: those that arrived under it within
        ``window_s``, or, where fewer than ``min_samples`` did (a low rate of long
        requests), the latest ``min_samples`` that arrived under it; none if too few."""
        under = [s for s in self.samples if s.arrived >= self.changed_at]
        recent = [s for s in under if s.arrived >= now - self.config.window_s]
        if len(recent) >= self.config.min_samples:
            return recent
        return under[-self.config.min_samples :] if len(under) >= self.config.min_samples else []

    def apply(self, roles: Sequence[Role], why: str) -> None:
        """Set ``roles`` (by worker index), one log line per worker whose role changes."""
        for i, (old, role) in enumerate(zip(self.table.roles(), roles, strict=True)):
            if self.table.set(i, role):
                logger.info("worker %d: role %s -> %s (%s)", i, old.value, role.value, why)


class _PrefillRate:
    """Prompt tokens/s one worker computes while it has prompts queued, from the rows'
    cumulative ``computed_prefill_tokens`` (exponentially averaged; 0 until measured)."""

    def __init__(self) -> None:
        self.rate = 0.0
        self._last: dict[tuple[int, int], tuple[float, int, int]] = {}

    def update(self, rows: Sequence[LoadRow], now: float) -> None:
        for r in rows:
            key = (r.index, r.generation)
            last = self._last.get(key)
            self._last[key] = (now, r.computed_prefill_tokens, r.queued_prefill_tokens)
            if last is None or now <= last[0] or not last[2]:
                continue  # no earlier figure, or it had nothing queued then
            rate = (r.computed_prefill_tokens - last[1]) / (now - last[0])
            if rate > 0:
                self.rate = rate if not self.rate else 0.8 * self.rate + 0.2 * rate
