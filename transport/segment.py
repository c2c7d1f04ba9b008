"""Shared-memory segments that never outlive their processes.

Lifecycle (docs/design.md §2): the launcher creates every segment before it spawns workers:
``shm_open(O_CREAT|O_EXCL, 0600)`` under a unique name ``pdserve.<creator pid>.<tag>``,
``posix_fallocate`` of the full size (so a small /dev/shm fails here with a message, not
with SIGBUS in a worker later; KV pools are only sized, see ``create``), then the name
is unlinked at once. Workers inherit the fd
(``subprocess.Popen(pass_fds=...)``) and map it; the memory lives exactly as long as some
process holds the fd or a mapping, so SIGKILL of every process leaves nothing in /dev/shm.
The only window in which a name exists is between ``shm_open`` and ``unlink`` in the
creator; ``sweep_stale`` removes what a creator killed inside that window left behind.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import posix_ipc

from transport.errors import ShmTooSmall
from wire.json_spec import JsonSpec

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_PREFIX = "pdserve."
_STALE = re.compile(r"^pdserve\.(\d+)\.")
_TAG = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@dataclass(frozen=True, slots=True)
class SegmentSpec(JsonSpec):
    """How a child finds a segment: the inherited fd number and the mapped size."""

    tag: str
    fd: int
    nbytes: int


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class Segment:
    """A mapped shared-memory segment. ``buf`` is writable; ``close()`` unmaps it."""

    def __init__(self, spec: SegmentSpec, owner: bool) -> None:
        self.spec = spec
        self.owner = owner
        self._mmap = mmap.mmap(spec.fd, spec.nbytes, mmap.MAP_SHARED)
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, tag: str, nbytes: int, *, reserve: bool = True) -> Segment:
        """Create, reserve and unlink a segment; the caller passes ``spec.fd`` to children.

        Raises ShmTooSmall when /dev/shm cannot hold ``nbytes``. ``reserve=False`` (KV pools)
        only sizes the segment: its pages are committed as they are first written, so a
        large pool costs memory as it fills, not at startup. /dev/shm's room is still
        checked here; the launcher's memory budget keeps pools within physical memory.
        """
        if not _TAG.match(tag):
            raise ValueError(f"segment tag {tag!r} must match {_TAG.pattern}")
        if nbytes <= 0:
            raise ValueError(f"segment {tag!r}: nbytes must be positive, got {nbytes}")
        free = shm_free_bytes()
        if nbytes > free:
            raise ShmTooSmall(tag, nbytes, free)
        name = f"/{_PREFIX}{os.getpid()}.{tag}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        try:
            if reserve:
                _reserve(shm.fd, nbytes, tag)
            else:
                os.ftruncate(shm.fd, nbytes)  # sparse: reads as zeros, committed on write
        finally:
            shm.unlink()
        return cls(SegmentSpec(tag=tag, fd=shm.fd, nbytes=nbytes), owner=True)

    @classmethod
    def attach(cls, spec: SegmentSpec) -> Segment:
        """Map a segment whose fd this process inherited (or created)."""
        return cls(spec, owner=False)

    @classmethod
    def attach_fd(cls, fd: int, nbytes: int, tag: str) -> Segment:
        return cls(SegmentSpec(tag=tag, fd=fd, nbytes=nbytes), owner=False)

    def close(self) -> None:
        """Unmap. The fd stays open: the launcher keeps it to hand to restarted workers."""
        self.buf.release()
        self._mmap.close()

    def close_fd(self) -> None:
        os.close(self.spec.fd)


def _reserve(fd: int, nbytes: int, tag: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise ShmTooSmall(tag, nbytes, shm_free_bytes()) from e
        raise


def sweep_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink ``pdserve.<pid>.*`` names whose creator is dead; returns the names removed."""
    removed = []
    for path in shm_dir.glob(f"{_PREFIX}*"):
        m = _STALE.match(path.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path.name)
        logger.warning("removed stale shared memory %s left by dead pid %s", path, m.group(1))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_running(pid: int) -> bool:
    """Whether this pid is a process that can run now: alive, and neither stopped
    (SIGSTOP, a debugger) nor a zombie. A stopped process keeps its pid, so
    ``pid_alive`` alone cannot tell that it will hold what it holds indefinitely."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux) or not ours to read: existence is all we know
        return pid_alive(pid)
    # "pid (comm) S ...": comm may itself hold spaces or parentheses, so split after
    # the last ')'.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"T", b"t", b"Z", b"X", b"x")
