"""``cuda_ipc`` pool handles: which decode worker has which prefill pool mapped.

A prefill GPU pool is mapped by decode workers from its handle (``KVPoolHandle``, plain
bytes) before they can copy from it. Both sides keep that bookkeeping here, pure and
without I/O, as ``PinnedBlocks`` does for blocks; the workers do the sending and mapping.

Who calls what, when (i = prefill worker, j = decode worker):

  prefill i, every loop iteration, before it ships KVTransfers
      ``HandleSender.due(live)``, ``live`` being every decode worker whose process is up
      (load-table rows STARTING or READY) with that process's generation: the decode
      workers to send ``KVPoolHandle(i, handle)`` to now, on ``kv.p{i}.d{j}``. The handle
      and the transfers share that ring, so (FIFO) a decode process has prefill i's handle
      before its first transfer from i.
      NOTE: generations, not ring pids. A restarted decode worker writes its pid into its
      rings when it attaches and only then discards what they hold (``Ring.reset``): a
      handle sent on seeing the new pid could be discarded with the rest. It claims its
      load-table row, which bumps the generation, after that reset.
  decode j, on ``KVPoolHandle`` from i
      ``PoolImports.is_new(i, handle)``: if so, drop any older mapping of i (with the
      transfers still pending from that older process), map the pool, then ``mapped``.
  decode j, every loop iteration
      for each mapped i whose ``kv.p{i}.d{j}`` producer has died: ``lost(i)``, drop the
      mapping (a dead process's GPU memory is not valid to read) and the transfers pending
      from it.
  decode j, on ``KVTransfer`` from i: ``verdict(i)``
      ACCEPT: mapped. DROP: from a prefill process that died; the frontend resumes such a
      request on live workers (it has at most its first token), so it is dropped silently.
      REFUSE: no handle ever came; answer ``KVRelease(accepted=False)`` so prefill frees
      the blocks, and end the request with an error rather than let it hang.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class HandleSender:
    """Prefill side: the decode processes (by generation) this pool's handle went to."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # decode worker -> generation sent to

    def due(self, live: Mapping[int, int]) -> list[int]:
        """Decode workers in ``live`` (index -> generation) not yet sent the handle.

        Marks them sent: the caller sends now. A send that fails because the process died
        needs no retry: its successor has a new generation.
        """
        due = [j for j, gen in sorted(live.items()) if self._sent.get(j) != gen]
        for j in due:
            self._sent[j] = live[j]
        return due


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DROP = "drop"
    REFUSE = "refuse"


class PoolImports:
    """Decode side: the handle of each mapped prefill pool, and prefill pools lost.

    Invariant: a prefill worker is in at most one of mapped and lost.
    """

    def __init__(self) -> None:
        self._handles: dict[int, bytes] = {}
        self._lost: set[int] = set()

    def is_new(self, prefill: int, handle: bytes) -> bool:
        """Is ``handle`` other than the one mapped for ``prefill`` (a new process's pool)?"""
        return self._handles.get(prefill) != handle

    def mapped(self, prefill: int, handle: bytes) -> None:
        self._handles[prefill] = handle
        self._lost.discard(prefill)

    def lost(self, prefill: int) -> None:
        """``prefill``'s process is gone: its mapping must go, its transfers are dropped."""
        if self._handles.pop(prefill, None) is not None:
            self._lost.add(prefill)

    def failed(self, prefill: int) -> None:
        """Mapping ``prefill``'s pool failed: its transfers are refused from now on."""
        self._handles.pop(prefill, None)
        self._lost.discard(prefill)

    def is_mapped(self, prefill: int) -> bool:
        return prefill in self._handles

    def verdict(self, prefill: int) -> Verdict:
        if prefill in self._handles:
            return Verdict.ACCEPT
        return Verdict.DROP if prefill in self._lost else Verdict.REFUSE
