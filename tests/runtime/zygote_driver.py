"""Drives a zygote in its own process (it makes itself a child subreaper, which the test
process must not become) and prints what it saw as one JSON line.

    python -m tests.runtime.zygote_driver <directory for reports> <modules to preload...>
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from runtime.zygote import MAX_FDS, MAX_MESSAGE, Zygote, ZygoteError, ZygoteRefused, reap_strays

CHILD = "tests.runtime.zygote_child"


class LosingZygote(Zygote):
    """Reads the zygote's answer, then says it never came (a reply lost to a timeout)."""

    lose_next = False
    lost_pid = 0

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        reply = super()._reply(timeout_s)
        if self.lose_next and "pid" in reply:
            self.lose_next, self.lost_pid = False, int(reply["pid"])
            raise ZygoteError("no answer (simulated)")
        return reply


def low_memfds(n: int) -> list[int]:
    """``n`` memfds at the lowest free numbers, each holding its own number: the numbers
    the zygote's received copies land on too, so moving them into place must not clobber
    one with another."""
    out = []
    for _ in range(n):
        fd = os.memfd_create("zygote-test")
        os.write(fd, str(fd).encode())
        out.append(fd)
    return out


def zombies(pids: set[int] | None = None) -> list[int]:
    """Our zombie children (of ``pids`` only, if given)."""
    kids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            kids += [int(pid) for pid in f.read().split()]
    out = []
    for pid in kids:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z" and (pids is None or pid in pids):
                out.append(pid)
    return out


def until(check: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def main() -> None:
    out, modules = sys.argv[1], sys.argv[2:]
    fds = list(reversed(low_memfds(20)))
    zygote = LosingZygote.start(modules)
    seen: dict[str, object] = {"driver": os.getpid(), "fds": fds}

    def env(name: str, act: str) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "REPORT": os.path.join(out, f"{name}.json"),
            "ACT": act,
            "FDS": json.dumps(fds),
            "OMP_NUM_THREADS": "2",
        }

    child = zygote.spawn(CHILD, env("exit", "exit:7"), fds)
    seen["exit_code"] = child.wait(30)
    seen["wait_again"] = child.wait(0)  # reaped already: the code again, as Popen's

    child = zygote.spawn(CHILD, env("sleep", "sleep"), fds)
    try:
        child.wait(0.2)
        seen["wait_timed_out"] = False
    except subprocess.TimeoutExpired:
        seen["wait_timed_out"] = True
    child.send_signal(signal.SIGKILL)
    seen["killed_code"] = child.wait(30)

    # A known child's zombie is left to its owner; an unknown one's is reaped.
    child = zygote.spawn(CHILD, env("known", "exit:5"), fds)
    until(lambda: zombies({child.pid}))
    reap_strays({zygote.proc.pid, child.pid})
    seen["known_code"] = child.poll()
    child = zygote.spawn(CHILD, env("orphan", "orphan"), fds)
    child.wait(30)
    seen["orphan_zombie"] = bool(until(zombies))
    reap_strays({zygote.proc.pid})
    seen["zombies_after"] = len(zombies())

    # An answer lost after the fork: the child never gets its go and leaves at once.
    zygote.lose_next = True
    with contextlib.suppress(ZygoteError):
        zygote.spawn(CHILD, env("lost", "sleep"), fds)
    lost = zygote.lost_pid
    until(lambda: zombies({lost}))
    _, status = os.waitpid(lost, 0)
    seen["lost_code"] = os.waitstatus_to_exitcode(status)
    seen["lost_reported"] = os.path.exists(os.path.join(out, "lost.json"))

    refused = []
    many = [os.dup(fds[0]) for _ in range(MAX_FDS + 1)]
    for name, extra, sent in (("fds", {}, many), ("long", {"BIG": "x" * MAX_MESSAGE}, fds)):
        try:
            zygote.spawn(CHILD, {**env(name, "exit:0"), **extra}, sent)
        except ZygoteRefused as e:
            refused.append(str(e))
    seen["refused"] = refused
    seen["after_refusals"] = zygote.spawn(CHILD, env("after", "exit:3"), fds).wait(30)

    zygote.proc.send_signal(signal.SIGKILL)
    zygote.proc.wait()
    try:
        zygote.spawn(CHILD, env("late", "exit:0"), fds)
        seen["after_death"] = "spawned"
    except ZygoteError as e:
        seen["after_death"] = str(e)
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
