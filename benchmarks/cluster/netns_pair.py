"""Two stand-in hosts on one machine: a pair of Linux network namespaces joined by a veth.

Multi-host work (prefill on one machine, decode on another, KV moved over the network)
needs tests and benchmarks that cross a real network interface, with its own addresses,
routing and kernel TCP stack, without a second machine. A network namespace gives a
process its own interfaces; two of them joined by a veth pair are as close to two hosts
on one wire as one kernel gets (memory and CPUs stay shared, which is what makes the
shared-memory comparison in ``benchmarks.cluster.nixl_link`` possible at all).

The rules this module keeps, because it runs as root on shared machines:

- Traffic stays inside: the only addresses it assigns are one /30 (``SUBNET``) on the two
  veth ends, and they exist only inside the two namespaces. Nothing is added to the
  host's own namespace, so nothing a test sends there can reach another machine.
- Nothing outlives its test: ``__exit__`` kills the processes it started (and any other
  process still inside its namespaces), then deletes both namespaces; deleting a
  namespace destroys its end of the veth, and a veth dies with either end. An ``atexit``
  hook covers a creator that exits without unwinding, and ``sweep_stale`` (run on every
  entry) removes what a creator killed by a signal left behind: names carry the creating
  pid, so a namespace whose creator is gone is known to be an orphan.

    with NetnsPair() as pair:
        server = pair.popen("a", [sys.executable, "server.py", pair.addr("a")])
        pair.run("b", [sys.executable, "client.py", pair.addr("a")], timeout=10)
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from transport.segment import pid_alive

Side = Literal["a", "b"]
PREFIX = "pdsv"
# 10.213.117.0/30: two usable addresses, one per end. Private space picked to be unlikely
# on a real network; it is assigned only inside our own namespaces, so even a collision
# with a host route could not send anything off the machine.
SUBNET = ("10.213.117.1", "10.213.117.2", 30)
# ``pdsv<pid>_<k><side>``: k tells apart pairs one process holds at once; the pid is what
# ``sweep_stale`` checks. Short enough to double as the interface name (15 characters).
_NAME = re.compile(rf"^{PREFIX}(\d+)_(\d+)([abp])$")
_IP_TIMEOUT = 10.0  # seconds for one ``ip`` command; they take milliseconds
_seq = itertools.count()
_live: set[NetnsPair] = set()
_live_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, check=check, timeout=_IP_TIMEOUT
    )


def list_namespaces() -> list[str]:
    """Names of every named network namespace (``ip netns list``, ids stripped)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str, grace: float = 2.0) -> None:
    """End every process still inside namespace ``ns``: a namespace with a process in it
    survives ``ip netns del`` as an anonymous one, holding its veth and addresses."""
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.02)
        pids = [p for p in pids if pid_alive(p)]
        if not pids:
            return


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete this project's namespaces whose creating process no longer exists.

    Returns the names removed. A creator killed by SIGKILL runs neither ``__exit__`` nor
    ``atexit``; its namespaces would otherwise stay for the life of the machine. A reused
    pid hides an orphan until that process too is gone: harmless, and the next sweep
    after it takes it.
    """
    removed = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            _delete(ns)
            removed.append(ns)
    return removed


_available: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether namespaces and veths can be made here, and why not when they cannot.

    Checked by doing it once (a namespace with a veth inside, then deleted), since root
    alone is not enough: a container may lack CAP_SYS_ADMIN or the veth driver. The
    answer is cached for the process.
    """
    global _available
    if _available is not None:
        return _available
    if os.geteuid() != 0:
        _available = (False, "network namespaces need root (euid is not 0)")
    elif shutil.which("ip") is None:
        _available = (False, "no `ip` command (iproute2) on PATH")
    else:
        probe = f"{PREFIX}{os.getpid()}_{next(_seq)}p"
        try:
            _ip("netns", "add", probe)
            try:
                _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            finally:
                _ip("netns", "del", probe, check=False)
            _available = (True, "")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            err = getattr(e, "stderr", "") or str(e)
            _available = (False, f"cannot create a network namespace with a veth: {err}")
    return _available


class NetnsPair:
    """Two namespaces ``a`` and ``b`` joined by a veth, ``lo`` up in each.

    ``a`` holds ``SUBNET[0]``, ``b`` holds ``SUBNET[1]``; each end's interface has the
    same name as its namespace (``dev(side)``), which is what ``UCX_NET_DEVICES`` and
    similar per-interface settings need. Processes are run with ``ip netns exec``, which
    enters the namespace and then execs the command: the pid ``popen`` returns is the
    command's own.
    """

    def __init__(self) -> None:
        k = next(_seq)
        self.names: dict[Side, str] = {s: f"{PREFIX}{os.getpid()}_{k}{s}" for s in ("a", "b")}
        self._procs: list[subprocess.Popen[Any]] = []
        self._up = False

    def ns(self, side: Side) -> str:
        return self.names[side]

    def dev(self, side: Side) -> str:
        """This side's veth end (named as its namespace)."""
        return self.names[side]

    def addr(self, side: Side) -> str:
        return SUBNET[0] if side == "a" else SUBNET[1]

    def cores(self, side: Side) -> list[int]:
        """``side``'s own cores, as a host of its own has them: half of this process's
        cores each (``a`` the lower half). Empty (share them all) on a single core.

        Namespaces separate the network only: two nodes on one machine would each lease
        every core to their workers (``transport/core_lease.py`` counts one host's), and
        their thread pools would then fight over the same cores (a 256-token prefill step
        measured 6.3 s instead of 0.1 s)."""
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) < 2:
            return []
        half = len(mine) // 2
        return mine[:half] if side == "a" else mine[half:]

    def __enter__(self) -> NetnsPair:
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        sweep_stale()
        with _live_lock:
            _live.add(self)
        self._up = True
        try:
            a, b = self.names["a"], self.names["b"]
            _ip("netns", "add", a)
            _ip("netns", "add", b)
            # Created straight into the two namespaces: the host namespace never sees it.
            _ip("link", "add", a, "netns", a, "type", "veth", "peer", "name", b, "netns", b)
            for side in ("a", "b"):
                ns = self.names[side]
                _ip("-n", ns, "addr", "add", f"{self.addr(side)}/{SUBNET[2]}", "dev", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", ns, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what was started, delete both namespaces (idempotent)."""
        if not self._up:
            return
        self._up = False
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for ns in self.names.values():
            _delete(ns)
        with _live_lock:
            _live.discard(self)

    def argv(self, side: Side, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside ``side``'s namespace."""
        return ["ip", "netns", "exec", self.names[side], *argv]

    def popen(self, side: Side, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``side`` (``subprocess.Popen`` keywords pass through;
        ``env`` is inherited across ``ip netns exec``). Killed on exit if still running."""
        if not self._up:
            raise RuntimeError("NetnsPair is not entered")
        proc = subprocess.Popen(self.argv(side, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(
        self, side: Side, argv: Sequence[str], timeout: float, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``side`` to completion, text output captured, at most
        ``timeout`` seconds (``subprocess.TimeoutExpired`` past it, the process killed)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(side, argv), timeout=timeout, **kw)

    def set_link(self, up: bool) -> None:
        """Cut the veth (both ends down) or mend it: a partition between the two hosts
        that every process on either side sees, as a pulled cable would be seen."""
        for side in ("a", "b"):
            _ip("-n", self.names[side], "link", "set", self.names[side], "up" if up else "down")

    def link_bytes(self, side: Side) -> tuple[int, int]:
        """(received, sent) byte counters of ``side``'s veth end: whether traffic really
        crossed the link, not only where a library was told to send it."""
        out = _ip("-n", self.names[side], "-j", "-s", "link", "show", "dev", self.names[side])
        stats = json.loads(out.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


class NetnsLaunch:
    """One ``launch`` (``python -m launcher.cli argv``) inside a side of ``pair``, UCX
    pinned to TCP on that side's veth, on that side's own cores unless ``own_cores`` is
    False (a lone host, which has the machine); its output kept for readiness checks and
    reports."""

    def __init__(
        self, pair: NetnsPair, side: Side, argv: Sequence[str], own_cores: bool = True
    ) -> None:
        import sys

        # TCP: within one machine UCX would otherwise pick shared memory, past the veth.
        # The interface is the launcher's to choose (its cluster address's), as on hosts.
        env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
        env["UCX_TLS"] = "tcp"
        cmd = [sys.executable, "-m", "launcher.cli", *argv]
        # A node of several runs on its side's own cores (``NetnsPair.cores``); the
        # launcher's children inherit the affinity, and the core lease counts it.
        cpus = pair.cores(side) if own_cores else []
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = pair.popen(
            side,
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=pin,
        )
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def wait_for(self, needle: str, timeout_s: float = 300) -> None:
        """Until a line holds ``needle``; RuntimeError with the log's tail if the process
        exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while not any(needle in line for line in self.log):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no {needle!r}:\n" + "".join(self.log[-40:]))
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (the launcher stops its workers), SIGKILL past 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@atexit.register
def _close_all() -> None:
    with _live_lock:
        pairs = list(_live)
    for pair in pairs:
        pair.close()
