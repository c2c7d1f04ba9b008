"""Run by ``zygote_driver`` through the zygote: reports what a forked child sees.

Writes a JSON report to ``$REPORT``, then acts as ``$ACT`` says: ``exit:N`` exits with N,
``sleep`` sleeps until killed, ``orphan`` leaves a child behind that exits once it has
been re-parented.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import sys
import time


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def _orphan() -> None:
    parent = os.getpid()
    if os.fork() == 0:
        deadline = time.monotonic() + 30
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(0)


if __name__ == "__main__":
    fds = {}
    for target in json.loads(os.environ["FDS"]):
        os.lseek(target, 0, os.SEEK_SET)
        fds[str(target)] = os.read(target, 64).decode()
    report = {
        "name": __name__,
        "argv0": sys.argv[0],
        "ppid": os.getppid(),
        "env": dict(os.environ),
        "fds": fds,
        "open_fds": [fd for fd in range(1024) if _is_open(fd)],
        "gc_enabled": gc.isenabled(),
        "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }
    with open(os.environ["REPORT"], "w") as f:
        json.dump(report, f)
    act = os.environ["ACT"]
    if act == "sleep":
        time.sleep(60)
    elif act == "orphan":
        _orphan()
        sys.exit(0)
    sys.exit(int(act.split(":")[1]))
