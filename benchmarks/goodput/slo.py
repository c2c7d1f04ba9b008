"""SLO attainment of a sweep point and the goodput of a sweep. Pure: no I/O.

Goodput follows DistServe: the request rate at which SLO attainment falls to the target
(90 %), linearly interpolated between the highest swept rate that still met it and the
next swept rate, the first that did not. A sweep that never meets the target has no
goodput within its range (``below``); one that always meets it has goodput of at least
its highest rate (``at_least``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

TARGET = 0.9


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError(f"SLOs must be positive, got {self}")


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it (seconds); ``tpot`` is None under two tokens.

    ``cut``: still streaming at its point's deadline and judged on what it showed by then
    (``ok`` once it had two tokens; ``tpot`` the mean gap between its chunks so far).
    Arrivals have stopped by then, so its remaining tokens come no slower than those.
    """

    ok: bool
    ttft: float
    tpot: float | None
    cut: bool = False

    def meets(self, slo: Slo) -> bool:
        if not self.ok:
            return False
        # One output token has no inter-token time: it meets any TPOT target.
        tpot_ok = self.tpot is None or self.tpot * 1000 <= slo.tpot_ms
        return self.ttft * 1000 <= slo.ttft_ms and tpot_ok


def attainment(outcomes: list[Outcome], slo: Slo) -> float:
    """Fraction of ``outcomes`` that finished and met both targets (failures count as
    misses); 0 for no requests, which proves nothing met the targets."""
    if not outcomes:
        return 0.0
    return sum(o.meets(slo) for o in outcomes) / len(outcomes)


def percentiles_ms(values: list[float], ps: tuple[float, ...] = (50, 90)) -> list[float | None]:
    """The ``ps`` percentiles of ``values`` (seconds) in milliseconds; None when empty."""
    if not values:
        return [None for _ in ps]
    arr = np.asarray(values, dtype=np.float64) * 1000
    return [float(np.percentile(arr, p)) for p in ps]


class Bound(Enum):
    EXACT = "exact"  # the target is crossed inside the swept range
    BELOW = "below"  # even the lowest rate missed it: goodput under that rate
    AT_LEAST = "at_least"  # every rate met it: goodput at least the highest rate


@dataclass(frozen=True)
class Goodput:
    rate: float  # EXACT: the crossing; BELOW: the lowest rate; AT_LEAST: the highest
    bound: Bound

    def text(self) -> str:
        if self.bound is Bound.BELOW:
            return f"< {self.rate:g}"
        if self.bound is Bound.AT_LEAST:
            return f">= {self.rate:g}"
        return f"{self.rate:.2f}"

    def value(self) -> float:
        """A number to compare sweeps by: 0 below the range, the bound otherwise."""
        return 0.0 if self.bound is Bound.BELOW else self.rate


def goodput(points: list[tuple[float, float]], target: float = TARGET) -> Goodput:
    """Goodput of ``(rate, attainment)`` points: see the module docstring.

    The crossing is taken at the first rate, in increasing order, that misses the target:
    a higher rate that meets it again after a miss is noise and does not raise goodput.
    """
    if not points:
        raise ValueError("goodput of an empty sweep")
    pts = sorted(points)
    rates = [r for r, _ in pts]
    if len(set(rates)) != len(rates):
        raise ValueError(f"a sweep measures each rate once, got {rates}")
    miss = next((i for i, (_, a) in enumerate(pts) if a < target), None)
    if miss is None:
        return Goodput(pts[-1][0], Bound.AT_LEAST)
    if miss == 0:
        return Goodput(pts[0][0], Bound.BELOW)
    (r0, a0), (r1, a1) = pts[miss - 1], pts[miss]
    # a0 >= target > a1, so the fraction lies in [0, 1).
    return Goodput(r0 + (a0 - target) / (a0 - a1) * (r1 - r0), Bound.EXACT)
