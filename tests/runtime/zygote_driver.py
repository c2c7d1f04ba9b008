"""Drives a zygote in its own process (it makes itself a child subreaper, which the test
process must not become) and prints what it saw as one JSON line.

    python -m tests.runtime.zygote_driver <directory for reports> <modules to preload...>
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from runtime.zygote import MAX_FDS, MAX_MESSAGE, Zygote, ZygoteError, ZygoteRefused, reap_strays

CHILD = "tests.runtime.zygote_child"


def memfd_at(text: str, number: int) -> int:
    """A memfd holding ``text`` at fd ``number`` (the numbers a spec would name)."""
    fd = os.memfd_create("zygote-test")
    os.write(fd, text.encode())
    os.dup2(fd, number)
    os.close(fd)
    return number


def main() -> None:
    out, modules = sys.argv[1], sys.argv[2:]
    # Targets the zygote's own received fds are likely to land on, in reverse order.
    fds = [memfd_at("first", 9), memfd_at("second", 8), memfd_at("third", 41)]
    zygote = Zygote.start(modules)
    seen: dict[str, object] = {"driver": os.getpid()}

    def env(name: str, act: str) -> dict[str, str]:
        report = os.path.join(out, f"{name}.json")
        return {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "REPORT": report,
            "ACT": act,
            "FDS": json.dumps(fds),
            "OMP_NUM_THREADS": "2",
        }

    child = zygote.spawn(CHILD, env("exit", "exit:7"), fds)
    seen["exit_code"] = child.wait(30)

    child = zygote.spawn(CHILD, env("sleep", "sleep"), fds)
    try:
        child.wait(0.2)
        seen["wait_timed_out"] = False
    except subprocess.TimeoutExpired:
        seen["wait_timed_out"] = True
    child.send_signal(signal.SIGKILL)
    seen["killed_code"] = child.wait(30)

    child = zygote.spawn(CHILD, env("orphan", "orphan"), fds)
    child.wait(30)
    time.sleep(1.0)  # the orphan has exited by now: a zombie of ours
    before = _zombies()
    reap_strays({zygote.proc.pid})
    seen["zombies_before"], seen["zombies_after"] = before, _zombies()

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


def _zombies() -> int:
    kids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            kids += f.read().split()
    states = []
    for pid in kids:
        with open(f"/proc/{pid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return states.count("Z")


if __name__ == "__main__":
    main()
