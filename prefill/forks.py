"""Requests waiting on a prefill worker, and the choices of ``n > 1`` requests that share
their leader's prompt KV.

The frontend sends the ``n`` choices of a request as ``n`` GenerateRequests to one
prefill worker, back to back: the first (the leader) says how many forks follow, each
fork names the leader. A fork never enters the waiting queue: it waits in its leader's
group, costs no prefill, and at the leader's sampling step is forked from it
(``KVPool.fork``: the prompt's blocks shared, not recomputed nor allocated again)
and sampled from the same logits row with its own seed.

NOTE: the leader holds back only its last prompt token (its logits are what the forks
share) and only until its forks are in or ``FORK_WAIT_S`` has passed: a fork that comes
later, or whose leader is gone, is an ordinary request (and prefix caching still lends
it the prompt's full blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv.sequence import Sequence
from wire.records import GenerateRequest

FORK_WAIT_S = 0.05


@dataclass(eq=False)  # identity: queues remove this very request
class PrefillRequest:
    """A request on a prefill worker until its first token is sampled."""

    seq: Sequence
    decode_worker: int
    detok_shard: int


@dataclass
class _Group:
    expected: int
    deadline: float
    forks: list[PrefillRequest] = field(default_factory=list)


class Forks:
    """Leaders' groups by leader rid (leaders themselves wait in the scheduler's queue)."""

    def __init__(self) -> None:
        self._groups: dict[int, tuple[PrefillRequest, _Group]] = {}

    def lead(self, p: PrefillRequest, req: GenerateRequest) -> None:
        """``p`` (just queued) expects ``req.forks`` forks."""
        if req.forks > 0 and not req.output_ids:
            group = _Group(req.forks, time.monotonic() + FORK_WAIT_S)
            self._groups[req.rid] = (p, group)

    def join(self, req: GenerateRequest, p: PrefillRequest) -> bool:
        """Put fork ``p`` in its leader's group; False if there is no group to join."""
        entry = self._groups.get(req.fork_of)
        if entry is None or req.output_ids:
            return False
        leader, group = entry
        if leader.seq.prompt_ids != req.prompt_ids or leader.seq.output_ids:
            return False
        group.forks.append(p)
        return True

    def holds_back(self, leader: PrefillRequest) -> bool:
        """Should ``leader`` wait for more forks before it is sampled?"""
        entry = self._groups.get(leader.seq.rid)
        if entry is None:
            return False
        group = entry[1]
        return len(group.forks) < group.expected and time.monotonic() < group.deadline

    def of(self, leader: PrefillRequest) -> list[PrefillRequest]:
        entry = self._groups.get(leader.seq.rid)
        return entry[1].forks if entry is not None else []

    def take(self, leader: PrefillRequest) -> list[PrefillRequest]:
        """The leader is sampled now: its forks, and the group is closed."""
        entry = self._groups.pop(leader.seq.rid, None)
        return entry[1].forks if entry is not None else []

    def abort(self, rid: int) -> list[PrefillRequest]:
        """Drop ``rid`` if it is a fork; if a leader, close its group and return its forks
        (the caller queues them as ordinary requests)."""
        entry = self._groups.pop(rid, None)
        if entry is not None:
            return entry[1].forks
        for _, group in self._groups.values():
            group.forks = [f for f in group.forks if f.seq.rid != rid]
        return []

    @property
    def num_forks(self) -> int:
        return sum(len(group.forks) for _, group in self._groups.values())
