"""What a proposer of draft tokens is, for the speculator (engine/speculative/speculator.py).

Who calls what, when (all from the decode worker's step, one thread):
- ``propose(seqs, ks)`` once per step, for the requests the speculator lets speculate:
  at most ``ks[i]`` draft tokens to follow ``seqs[i].all_ids``. A proposer reads each
  sequence's tokens as they are now and catches up on whatever was appended since its
  last call (accepted tokens only: a sequence's tokens never include a rejected draft).
- ``release(rid)`` when a request leaves this worker (finished, aborted); its state goes.

NOTE: drafts must be a deterministic function of the tokens: verification accepts a
draft only where the target's own sample equals it, so any proposer keeps outputs
identical to decoding without speculation; a better proposer is only faster.
"""

from __future__ import annotations

import abc

from engine.kv.sequence import Sequence


class Proposer(abc.ABC):
    # True: a proposal costs next to nothing (a lookup), so the speculator may ask for
    # drafts it will not verify, to measure their acceptance (engine/speculative/cost.py).
    cheap = False

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` drafts for each ``seqs[i]`` (an empty list: nothing to offer)."""

    @abc.abstractmethod
    def release(self, rid: int) -> None:
        """Forget ``rid`` (no-op if unknown)."""
