"""Placement policies: which of the routable workers of one role takes a request.

A policy sees candidates (index, cost in tokens, tokens assigned so far) already filtered
to live workers with room; ``router/router.py`` computes the costs.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class PolicyName(enum.StrEnum):
    LEAST_LOAD = "least-load"
    POWER_OF_TWO = "power-of-two"
    ROUND_ROBIN = "round-robin"


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


def _key(c: Candidate) -> tuple[int, int, int]:
    return c.key
