"""Spawning, watching, restarting and stopping the children of one server.

Every child is a fresh interpreter (``python -m <role module>``) that inherits exactly the
fds its spec names. The supervisor watches each child's pidfd, so a death is seen at once
(well within the 1 s promise); a dead worker's load-table row is marked DEAD before it is
restarted, so the router stops placing work there immediately.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pdserve.process import SPEC_ENV, ProcessSpec
from router.load_table import LoadTable, WorkerState

logger = logging.getLogger(__name__)

MODULES = {
    "frontend": "frontend.server",
    "prefill": "prefill.worker",
    "decode": "decode.worker",
    "colocated": "colocated.worker",
    "detok": "detokenizer.worker",
}
SHUTDOWN_GRACE_S = 8.0  # SIGTERM, then SIGKILL: everything is gone within 10 s


def describe_exit(code: int | None) -> str:
    """How a child ended, in words; a SIGKILL nobody here sent is most often the OOM killer."""
    if code is None or code >= 0:
        return f"code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return (f"killed by {name}, possibly by the kernel's OOM killer (see `dmesg`); if so, "
                "lower --kv-cache-tokens or run fewer workers")  # fmt: skip
    return f"killed by {name}"


class ChildFailed(RuntimeError):
    """A child died during startup, or the frontend died: the server cannot go on."""


@dataclass
class Child:
    spec: ProcessSpec
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    restarts: int = 0
    started_at: float = field(default=0.0)

    @property
    def name(self) -> str:
        return (
            self.spec.role
            if self.spec.role == "frontend"
            else f"{self.spec.role}-{self.spec.index}"
        )

    def start(self) -> None:
        env = {**os.environ, **self.env, SPEC_ENV: self.spec.to_json()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULES[self.spec.role]],
            env=env,
            pass_fds=self.spec.fds(),
            start_new_session=False,
        )
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.started_at = time.monotonic()
        logger.info("started %s (pid %d)", self.name, self.proc.pid)

    def reap(self) -> int | None:
        """The exit code if the child has exited (and close its pidfd), else None."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None and self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        return code


class Supervisor:
    def __init__(self, children: list[Child], table: LoadTable, num_prefill: int) -> None:
        self.children = children
        self.table = table
        self.num_prefill = num_prefill
        self.stopping = False

    def start_all(self) -> None:
        for child in self.children:
            child.start()

    def wait_ready(self, timeout_s: float, frontend_ready: object) -> None:
        """Until every worker row is READY and ``frontend_ready()`` is true."""
        deadline = time.monotonic() + timeout_s
        workers = sum(1 for c in self.children if c.spec.role in ("prefill", "decode", "colocated"))
        while time.monotonic() < deadline and not self.stopping:
            for child in self.children:
                code = child.reap()
                if code is not None:
                    raise ChildFailed(f"{child.name} exited during startup ({describe_exit(code)})")
            rows = [r for r in self.table.snapshot() if r.state == WorkerState.READY]
            if len(rows) == workers and callable(frontend_ready) and frontend_ready():
                return
            time.sleep(0.1)
        if not self.stopping:
            raise ChildFailed(f"server not ready after {timeout_s:.0f} s")

    def monitor(self) -> int:
        """Restart dead workers until asked to stop; returns the launcher's exit code."""
        while not self.stopping:
            fds = {c.pidfd: c for c in self.children if c.pidfd >= 0}
            ready, _, _ = select.select(list(fds), [], [], 0.5)
            for fd in ready:
                child = fds[fd]
                code = child.reap()
                if code is None or self.stopping:
                    continue
                if child.spec.role == "frontend":
                    logger.error("the frontend exited (%s); shutting down", describe_exit(code))
                    return 1
                self._restart(child, code)
        return 0

    def _restart(self, child: Child, code: int) -> None:
        logger.error("%s exited (%s); restarting", child.name, describe_exit(code))
        slot = child.spec.load_table.get("slot", -1)
        if slot >= 0:
            self.table.writer(slot).set_state(WorkerState.DEAD)
        child.restarts += 1
        child.start()

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period."""
        self.stopping = True
        live = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for c in live:
            assert c.proc is not None
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM; killing it", c.name)
                c.proc.kill()
                c.proc.wait()
        for c in self.children:
            if c.pidfd >= 0:
                os.close(c.pidfd)
                c.pidfd = -1
