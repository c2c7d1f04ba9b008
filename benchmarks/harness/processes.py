"""A process tree as /proc shows it: parents, descendants and their titles, open fds,
CPU time, RSS and the shared-memory segments each process maps (what the leak, memory
and load benchmarks read)."""

from __future__ import annotations

import os
from pathlib import Path


def parents() -> dict[int, int]:
    """pid -> parent pid of every process (one /proc scan)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parent


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (parent links followed)."""
    parent = parents()
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier]
        tree += frontier
    return tree


def titled_tree(root: int) -> dict[str, int]:
    """``root``'s descendants by title (``pdserve:detok-0``, as ``ps`` shows it)."""
    out: dict[str, int] = {}
    for pid in process_tree(root)[1:]:
        try:
            out[Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()] = pid
        except OSError:  # it exited meanwhile
            continue
    return out


def stat_cpu_seconds(stat_line: str, ticks: int) -> float:
    """User + system CPU seconds from a ``/proc/<pid>/stat`` line (the command name, in
    parentheses, may hold spaces: fields are counted after its closing one)."""
    fields = stat_line.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far, all its threads (0 once it is gone)."""
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))
    except OSError:
        return 0.0


def open_fds(pid: int) -> int:
    """How many fds ``pid`` holds open (0 once it has exited)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def rss_bytes(pid: int) -> int:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except OSError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def shm_segments(pid: int) -> dict[int, int]:
    """Shared-memory segments ``pid`` maps or holds open: inode -> bytes.

    Segments are unlinked right after creation (see transport/segment.py), so they never
    show in a /dev/shm listing; the fds and mappings are what hold them alive.
    """
    out: dict[int, int] = {}
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                extent = int(parts[2], 16) + hi - lo
                out[int(parts[4])] = max(out.get(int(parts[4]), 0), extent)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                out[st.st_ino] = st.st_size
    except OSError:
        pass  # the process exited (or the fd closed) while we read
    return out
