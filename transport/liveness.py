"""Knowing, within a second, that the process across a ring has died.

Each side of a ring writes its pid into the ring header when it attaches. ``PeerWatch``
reads the peer's slot and holds a pidfd for that pid: a pidfd becomes readable the moment
its process exits (zombie or reaped), so it can sit in the same ``poll`` as the eventfds
and a blocked waiter wakes on death without any polling loop. A changed pid in the slot
means the launcher restarted the peer: the watch then follows the new process.
"""

from __future__ import annotations

import logging
import os
import select

from transport import _atomics

logger = logging.getLogger(__name__)


class PeerWatch:
    """Liveness of the process whose pid is stored (u64) at address ``slot_addr``."""

    def __init__(self, slot_addr: int, what: str) -> None:
        self._slot = slot_addr
        self._what = what
        self._pid = 0
        self._pidfd: int | None = None
        self._dead = False

    def _refresh(self) -> None:
        pid = _atomics.load_acquire(self._slot)
        if pid == self._pid:
            return
        self.close()
        self._pid, self._dead = pid, False
        if pid == 0:
            return
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._mark_dead()

    def _mark_dead(self) -> None:
        if not self._dead:
            logger.warning("%s (pid %d) has exited", self._what, self._pid)
        self._dead = True

    def alive(self) -> bool:
        """False once the attached peer has exited. A peer not yet attached counts as alive."""
        self._refresh()
        if self._dead or self._pidfd is None:
            return not self._dead
        # NOTE: poll, not select: a frontend holding thousands of connections gets a
        # restarted peer's pidfd numbered past FD_SETSIZE (1024), which select() refuses.
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        if poller.poll(0):
            self._mark_dead()
        return not self._dead

    def known_dead(self) -> bool:
        """True if death was already observed (no syscall; follows a restarted peer)."""
        self._refresh()
        return self._dead

    def pidfd(self) -> int | None:
        """An fd to poll for the peer's death; None if not attached or already known dead."""
        self._refresh()
        return None if self._dead else self._pidfd

    def on_pidfd_ready(self) -> None:
        self._mark_dead()

    @property
    def pid(self) -> int:
        return self._pid

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
