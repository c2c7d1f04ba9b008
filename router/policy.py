"""Placement policies: which of the routable workers of one role takes a request.

A policy sees candidates (index, cost in tokens, tokens assigned so far, and the tokens
this request would add there) already filtered to live workers with room;
``router/router.py`` computes the costs.

cache-aware, on prefill workers (``CacheAware``): the worker that would finish the
request's prefill soonest, in tokens: its queue (``cost``) plus the prompt tokens still to
compute once the prefix blocks it holds are reused (``new_tokens``). A worker holding a
conversation's history wins while its queue is shorter than the history it saves; a
longer queue sends the turn elsewhere, so load still bounds placement.
cache-aware, on decode workers (``CacheAffinity``): a decode step costs every running
request's whole KV whether its blocks are shared or not, so reuse saves decode no time,
only the handoff's copy and the memory of the blocks it holds. Decode load is therefore
still balanced first: among the workers within ``band`` of the least loaded (plus one
request's KV, so an idle pool does not scatter conversations), the one that holds the
longest prefix takes the request.
Without shared prefixes every ``new_tokens`` is equal and both are least-load.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class PolicyName(enum.StrEnum):
    CACHE_AWARE = "cache-aware"
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
    # Tokens this request would add here given the prefix the worker holds: prompt tokens
    # to compute (prefill), KV tokens to store (decode). Set only for cache-aware routing.
    new_tokens: int = 0

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


class CacheAware:
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return min(candidates, key=_cache_key)


class CacheAffinity:
    """Decode: the longest held prefix among the workers near the least loaded."""

    def __init__(self, band: float = 0.25) -> None:
        self.band = band

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        least = min(c.cost for c in candidates)
        one_request = max(c.new_tokens for c in candidates)  # its KV where nothing is held
        near = [c for c in candidates if c.cost <= least * (1 + self.band) + one_request]
        return min(near, key=_affinity_key)


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


def make_policy(name: PolicyName | str, seed: int | None = None, decode: bool = False) -> Policy:
    """The policy ``name`` for prefill (or co-located) workers, or for decode workers."""
    name = PolicyName(name)
    if name is PolicyName.CACHE_AWARE:
        return CacheAffinity() if decode else CacheAware()
    if name is PolicyName.LEAST_LOAD:
        return LeastLoad()
    if name is PolicyName.POWER_OF_TWO:
        return PowerOfTwo(seed)
    return RoundRobin()


def _key(c: Candidate) -> tuple[int, int, int]:
    return c.key


def _cache_key(c: Candidate) -> tuple[int, int, int]:
    return c.cost + c.new_tokens, c.assigned, c.index


def _affinity_key(c: Candidate) -> tuple[int, int, int, int]:
    return c.new_tokens, c.cost, c.assigned, c.index
