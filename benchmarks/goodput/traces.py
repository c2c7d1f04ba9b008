"""Request shapes and arrival schedules: Poisson arrivals over steady or phased traces.

A schedule is built whole before a point is sent (arrival times, and per arrival a
prompt length and an output length, all from one seed), so two configurations measured at
the same rate see the very same requests at the very same offsets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """A family of requests: prompt and output lengths drawn uniformly, bounds included."""

    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(*self.prompt), rng.randint(*self.output)


CHAT = Shape("chat", (100, 400), (100, 300))
DOC = Shape("doc", (1500, 3000), (20, 80))


@dataclass(frozen=True)
class Phase:
    """One phase of a trace: ``mix`` maps each shape to its share of arrivals."""

    name: str
    mix: tuple[tuple[Shape, float], ...]

    def pick(self, rng: random.Random) -> Shape:
        shapes, weights = zip(*self.mix)
        return rng.choices(shapes, weights=weights)[0]


STEADY_CHAT = (Phase("chat", ((CHAT, 1.0),)),)
STEADY_DOC = (Phase("doc", ((DOC, 1.0),)),)
# Phased: chat, then documents, then an even mix; the cycle repeats while the point lasts.
PHASED = (STEADY_CHAT[0], STEADY_DOC[0], Phase("mix", ((CHAT, 0.5), (DOC, 0.5))))
TRACES: dict[str, tuple[Phase, ...]] = {"chat": STEADY_CHAT, "doc": STEADY_DOC, "phased": PHASED}


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the point's start
    phase: str
    shape: str
    prompt_len: int
    output_len: int


def poisson_times(rate: float, count: int, rng: random.Random) -> list[float]:
    """The first ``count`` arrival offsets of a Poisson process of ``rate`` per second
    (exponential gaps; the first arrives after one gap, not at 0)."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if count < 1:
        raise ValueError(f"a point needs at least one request, got {count}")
    times, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def request_count(rate: float, duration_s: float, least: int, most: int) -> int:
    """Requests a point sends: ``rate * duration_s`` rounded, within [least, most]."""
    if not 1 <= least <= most:
        raise ValueError(f"need 1 <= least ({least}) <= most ({most})")
    return min(most, max(least, round(rate * duration_s)))


def phase_at(phases: tuple[Phase, ...], t: float, phase_s: float) -> Phase:
    """The phase a trace is in ``t`` seconds after its start (phases cycle)."""
    if phase_s <= 0:
        raise ValueError(f"phase length must be positive, got {phase_s}")
    return phases[int(t // phase_s) % len(phases)]


def schedule(
    phases: tuple[Phase, ...],
    rate: float,
    count: int,
    phase_s: float,
    seed: int,
) -> list[Arrival]:
    """The ``count`` requests of one sweep point; the same arguments give the same
    schedule."""
    times_rng, shape_rng = random.Random(seed), random.Random(seed + 1)
    out = []
    for t in poisson_times(rate, count, times_rng):
        phase = phase_at(phases, t, phase_s)
        shape = phase.pick(shape_rng)
        prompt_len, output_len = shape.draw(shape_rng)
        out.append(Arrival(t, phase.name, shape.name, prompt_len, output_len))
    return out
