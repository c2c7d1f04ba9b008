"""Spawning, watching, restarting and stopping the children of one server.

Every child runs ``python -m <role module>`` and inherits exactly the fds its spec names:
forked from the zygote (``runtime/zygote.py``: one interpreter that has imported torch and
the role modules, so the children share those pages) or, with ``--no-fork-workers`` or if
the zygote fails, as a fresh interpreter. The supervisor watches each child's pidfd, so a
death is seen at once (well within the 1 s promise); a dead worker's load-table row is marked DEAD before it is
restarted, so the router stops placing work there immediately.

Crash loops: a child is restarted after ``RESTART_BASE_S``, doubling with each death in
the last ``CRASH_WINDOW_S`` (at most ``RESTART_MAX_S``), so a worker that dies at once
(a bad flag, the OOM killer) does not burn the machine re-loading its model. After
``MAX_CRASHES`` deaths in the window it is FAILED, with how it died in its row for
``/health``, logged once, and left alone for a back-off (``failed_backoff``: from
``FAILED_BASE_S``, doubling each time, at most ``FAILED_MAX_S``) that ``/health`` shows
(the board's ``retry_at``); then it is started again. The server serves on while every
role has a live worker; a role whose every worker failed ends it (and ends a startup at
once).

Deaths a request is to blame for do not count: a frontend that ends a request as poison
(``frontend/engine_link/poison.py``) names the pids of the deaths it explains on the
board, and the crash-loop verdict, taken when a restart is due (at least
``EXPLAIN_GRACE_S`` after the death, time for the frontend to see it), leaves them out.
So crash loops, and the end of the server, come only from deaths no request explains
(start-up failures, bad weights, a broken device): never from what clients send.

Frontends (``--api-workers``) are children like any other: a dead one is marked DEAD on
the frontends' board (the others stop counting its reservations) and restarted with the
same back-off. Its clients' streams died with it; the other frontends' go on.
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
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.engine_link.board import FrontendBoard
from runtime.process import PARENT_ENV, SPEC_ENV, ProcessSpec
from runtime.strict_spec import EXIT_BAD_SPEC
from runtime.zygote import ForkedChild, Zygote, ZygoteError, ZygoteRefused, reap_strays
from transport.load_table import LoadTable, WorkerState, describe_exit
from wire.roles import Role

logger = logging.getLogger(__name__)

MODULES = {
    Role.FRONTEND: "frontend.http.server",
    Role.PREFILL: "prefill.worker",
    Role.DECODE: "decode.worker",
    Role.COLOCATED: "colocated.worker",
    Role.DETOK: "detokenizer.worker",
    Role.GATEWAY: "cluster.gateway",
}
# Roles that load the model's tokenizer once running: the zygote loads it for them (and
# with it most of transformers), so they share it.
TOKENIZER_ROLES = frozenset({Role.FRONTEND, Role.DETOK})
SHUTDOWN_GRACE_S = 8.0  # SIGTERM, then SIGKILL: everything is gone within 10 s
RESTART_BASE_S = 0.5
RESTART_MAX_S = 30.0
CRASH_WINDOW_S = 60.0
MAX_CRASHES = 5
EXPLAIN_GRACE_S = 1.0  # a crash-loop verdict waits this long for a frontend's explanation
FAILED_BASE_S = 30.0
FAILED_MAX_S = 300.0


def restart_delay(recent_deaths: int) -> float:
    """Seconds before restarting a child that died ``recent_deaths`` times in the window."""
    return min(RESTART_MAX_S, RESTART_BASE_S * 2 ** (recent_deaths - 1))


def failed_backoff(times_failed: int) -> float:
    """Seconds a child past its crash-loop limit for the ``times_failed``-th time waits."""
    return min(FAILED_MAX_S, FAILED_BASE_S * 2 ** (times_failed - 1))


class ChildFailed(RuntimeError):
    """Every worker of a role failed, or startup timed out: the server cannot go on."""


@dataclass
class Child:
    spec: ProcessSpec
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | ForkedChild | None = None
    pidfd: int = -1
    restarts: int = 0
    started_at: float = field(default=0.0)
    # (monotonic time, pid) of its deaths in the last window
    deaths: list[tuple[float, int]] = field(default_factory=list)
    restart_at: float | None = None  # a restart is due then (back-off)
    failed: str | None = None  # why it is in crash-loop back-off (or, with no restart_at, done)
    times_failed: int = 0
    last_exit: int = 0  # exit status of its last death

    @property
    def slot(self) -> int:
        return int(self.spec.load_table.get("slot", -1))

    @property
    def name(self) -> str:
        return self.spec.role.worker_name(self.spec.index)

    def start(self, zygote: Zygote | None = None) -> None:
        """Fork it from ``zygote`` (raises ``ZygoteError`` if that fails), or without one
        start a fresh interpreter."""
        env = {
            **os.environ,
            **self.env,
            SPEC_ENV: self.spec.to_json(),
            PARENT_ENV: str(os.getpid()),
        }
        module = MODULES[self.spec.role]
        if zygote is not None:
            self.proc = zygote.spawn(module, env, self.spec.fds())
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module],
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
    def __init__(
        self,
        children: list[Child],
        table: LoadTable,
        num_prefill: int,
        board: FrontendBoard | None = None,
        fork: bool = False,
        model: str | None = None,
    ) -> None:
        self.children = children
        self.table = table
        self.num_prefill = num_prefill
        self.board = board  # the frontends' (their rows' states are the launcher's word too)
        self.stopping = False
        self.fork = fork
        self.model = model  # the model directory whose tokenizer children load
        self.zygote: Zygote | None = None
        self.adopts = False  # a subreaper: a dead child's orphans become ours to reap

    def start_all(self) -> None:
        if self.fork:
            roles = {c.spec.role for c in self.children}
            modules = sorted({MODULES[r] for r in roles})
            tokenizer = self.model if roles & TOKENIZER_ROLES else None
            try:
                self.zygote = Zygote.start(modules, tokenizer)
                self.adopts = True
            except (ZygoteError, OSError) as e:
                logger.warning("no zygote (%s); children start as fresh interpreters", e)
        for child in self.children:
            self._start(child)

    def _start(self, child: Child) -> None:
        if self.zygote is not None:
            try:
                child.start(self.zygote)
                return
            except ZygoteRefused as e:
                logger.warning("%s starts as a fresh interpreter: %s", child.name, e)
            except ZygoteError as e:
                logger.warning(
                    "forking %s failed (%s); children start as fresh interpreters from now on",
                    child.name,
                    e,
                )
                self.zygote.close()
                self.zygote = None
        child.start()

    def wait_ready(self, timeout_s: float, frontend_ready: Callable[[], bool]) -> None:
        """Until every engine role has a READY worker and ``frontend_ready()`` is true.

        Workers that die meanwhile are restarted with back-off, as later on; startup fails
        when a role has no worker left that could become ready.
        """
        deadline = time.monotonic() + timeout_s
        roles = {c.spec.role for c in self.children if c.spec.role.is_engine}
        while time.monotonic() < deadline and not self.stopping:
            self._tend(0.1)
            ready = {r.role for r in self.table.snapshot() if r.state == WorkerState.READY}
            if roles <= ready and frontend_ready():
                return
        if not self.stopping:
            raise ChildFailed(f"server not ready after {timeout_s:.0f} s")

    def monitor(self) -> int:
        """Restart dead workers until asked to stop; returns the launcher's exit code."""
        while not self.stopping:
            try:
                self._tend(0.5)
            except ChildFailed as e:
                logger.error("%s; shutting down", e)
                return 1
        return 0

    def _tend(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a death or a due restart, and handle them."""
        now = time.monotonic()
        due = [c.restart_at for c in self.children if c.restart_at is not None]
        wait = max(0.0, min([timeout_s, *(t - now for t in due)]))
        fds = {c.pidfd: c for c in self.children if c.pidfd >= 0}
        ready, _, _ = select.select(list(fds), [], [], wait)
        for fd in ready:
            child = fds[fd]
            code = child.reap()
            if code is not None and not self.stopping:
                self._on_death(child, code)
        if self.adopts:
            known = {c.proc.pid for c in self.children if c.proc is not None}
            reap_strays(known | ({self.zygote.proc.pid} if self.zygote is not None else set()))
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None and now >= child.restart_at and not self.stopping:
                self._restart_due(child, now)

    def _restart_due(self, child: Child, now: float) -> None:
        """Restart ``child`` now, unless its unexplained deaths make it a crash loop (the
        window ends at its last death: the verdict is that death's, only taken later)."""
        last = child.deaths[-1][0] if child.deaths else now
        if child.failed is None and self._unexplained(child, last) >= MAX_CRASHES:
            self._fail(child, now)
            return
        if child.failed is not None:
            logger.warning("%s: its crash-loop back-off is over; starting it again", child.name)
            child.failed = None
            self._set_retry_at(child, 0.0)
        child.restart_at = None
        child.restarts += 1
        self._start(child)

    def _unexplained(self, child: Child, now: float) -> int:
        """Its deaths in the window that no frontend explained (``explain_deaths``)."""
        child.deaths = [(t, pid) for t, pid in child.deaths if now - t < CRASH_WINDOW_S]
        explained = self.board.explained() if self.board is not None else set()
        return sum(pid not in explained for _, pid in child.deaths)

    def _fail(self, child: Child, now: float) -> None:
        """Past its crash-loop limit: FAILED, and left alone for its back-off."""
        child.times_failed += 1
        wait = failed_backoff(child.times_failed)
        how = describe_exit(child.last_exit)
        child.failed = f"{how}; died {len(child.deaths)} times in {CRASH_WINDOW_S:.0f} s"
        logger.error(
            "%s %s: no longer restarted for now (crash-loop back-off: started again in %.0f s)",
            child.name,
            child.failed,
            wait,
        )
        child.deaths = []  # the next window starts after the back-off
        child.restart_at = now + wait
        self._mark(child, WorkerState.FAILED, child.last_exit)
        self._set_retry_at(child, time.time() + wait)
        self._check_roles()

    def _set_retry_at(self, child: Child, when: float) -> None:
        """Tell ``/health`` (the board) when a worker in back-off is started again."""
        if self.board is None:
            return
        if child.slot >= 0:
            self.board.set_retry_at(child.slot, when)
        elif child.spec.role is Role.DETOK:
            self.board.set_retry_at(self.board.num_workers + child.spec.index, when)

    def _on_death(self, child: Child, code: int) -> None:
        how = describe_exit(code)
        now = time.monotonic()
        if code == EXIT_BAD_SPEC:  # the same spec would be refused again: no restart
            child.failed = "refused its spec (its log line above names the field)"
            logger.error("%s %s: not restarted", child.name, child.failed)
            self._mark(child, WorkerState.FAILED, code)
            self._check_roles()
            return
        assert child.proc is not None
        child.deaths.append((now, child.proc.pid))
        child.last_exit = code
        recent = self._unexplained(child, now)
        # At the crash-loop limit the verdict waits for a frontend to explain the death.
        delay = EXPLAIN_GRACE_S if recent >= MAX_CRASHES else restart_delay(recent)
        verdict = " (unless that is a crash loop)" if recent >= MAX_CRASHES else ""
        logger.error("%s %s; restarting in %.1f s%s", child.name, how, delay, verdict)
        self._mark(child, WorkerState.DEAD, code)
        child.restart_at = now + delay

    def _mark(self, child: Child, state: WorkerState, code: int) -> None:
        if child.spec.role is Role.FRONTEND and self.board is not None:
            self.board.mark_dead(child.spec.index, failed=state == WorkerState.FAILED)
        if child.slot >= 0:
            # slots belong to engine workers only
            self.table.writer(child.slot).mark_exited(
                state, code, child.spec.role, child.spec.index
            )

    def _check_roles(self) -> None:
        """A role all of whose workers failed can serve nothing: give up."""
        roles: dict[Role, list[Child]] = {}
        for c in self.children:
            roles.setdefault(c.spec.role, []).append(c)
        for role, group in roles.items():
            if all(c.failed for c in group):
                raise ChildFailed(f"every {role} worker failed ({group[0].failed})")

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL what is left after the grace period."""
        self.stopping = True
        for c in self.children:
            c.restart_at = None
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
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
