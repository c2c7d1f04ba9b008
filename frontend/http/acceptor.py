"""The frontend's listening socket, served by a C accept thread (``frontend/http/_acceptor.c``).

The thread answers ``GET /health`` itself and hands every other connection to the loop,
where uvicorn serves it as if it had accepted it. For each probe the thread asks the loop
for a fresh report and waits up to ``WAIT_S``; a loop busier than that (a burst of
hundreds of arrivals queued ahead) has its probe answered from the last report, which the
loop also renews every ``REFRESH_S``. So a probe never waits behind the loop's queue, and
a loop stalled for longer than ``STALE_S`` turns the answer into 503 rather than a hang.

Who calls what: ``frontend.http.server`` binds the socket, starts uvicorn without a listener of
its own, then ``HealthAcceptor.start`` on the loop; at shutdown ``close`` stops accepting
before uvicorn closes the connections it has.

Why a thread in C, judged against simpler designs for the figure it exists for (``/health``
p99 < 100 ms while 500 streaming clients arrive, ``benchmarks/serving/overload.py``):
- Probes answered first on the loop (a pure-ASGI fast path, which ``frontend.http.app`` still
  has for probes that reach it): measured at p99 67-332 ms before this thread existed,
  because a probe still waits behind every handler queued ahead of it.
- A Python accept thread: not built. It would need the GIL for every accept, peek and
  answer, and the loop thread holds the GIL while it works through the burst, handing it
  over at most every switch interval (5 ms); a probe's latency would be several of those,
  set by the interpreter's scheduling rather than by us, and the thread would carry the
  same epoll/peek/handoff logic as the C one, only slower. Same complexity, weaker bound.
- This thread: p99 21-24 ms in the same benchmark (``benchmarks/results/overload.md``).
So it stays.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import socket
import sys
from collections.abc import Callable

from frontend.http import _acceptor

logger = logging.getLogger(__name__)

PEEK_S = 0.05  # a connection silent this long goes to the loop undecided
WAIT_S = 0.02  # a probe waits this long for a fresh report, then takes the last one
# The loop renews the report this often even when nobody asks. A report reads every
# worker's health and load row: on a 2-core Xeon that was about half an idle frontend's
# CPU at 4 renewals a second, and probes ask for a fresh one anyway.
REFRESH_S = 1.0
STALE_S = 3.0  # a report older than this: the loop has stopped turning; probes get 503


class HealthAcceptor:
    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        health: Callable[[], tuple[int, bytes]],
        *,
        refresh_s: float = REFRESH_S,
        stale_s: float = STALE_S,
        peek_s: float = PEEK_S,
    ) -> None:
        self.sock, self._factory, self._health = sock, protocol_factory, health
        self.refresh_s, self.stale_s, self.peek_s = refresh_s, stale_s, peek_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: _acceptor.Handle | None = None
        self._refresh: asyncio.TimerHandle | None = None
        self._read_fd, self._write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)  # the thread polls it together with stop()
        # Every fd in the pipe is an open fd of this process: a pipe that holds
        # RLIMIT_NOFILE of them never fills (best effort: pipe-max-size may cap it).
        try:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            fcntl.fcntl(self._write_fd, fcntl.F_SETPIPE_SZ, min(4 * nofile, 1 << 20))
        except (OSError, ValueError):
            pass
        self._connecting: set[asyncio.Task[None]] = set()
        self._want_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def start(self) -> None:
        """On the event loop: start accepting, and publish a first report at once."""
        self._loop = asyncio.get_running_loop()
        self.sock.setblocking(False)
        self._loop.add_reader(self._read_fd, self._adopt)
        self._loop.add_reader(self._want_fd, self._on_want)
        ms = [int(x * 1000) for x in (self.peek_s, WAIT_S, self.stale_s)]
        self._handle = _acceptor.start(self.sock.fileno(), self._write_fd, self._want_fd, *ms)
        self._renew()

    def _report(self) -> None:
        assert self._handle is not None
        try:
            status, body = self._health()
            _acceptor.set_health(self._handle, status, body)
        except Exception:  # a report that fails goes stale: probes then get 503
            logger.exception("health report failed")

    def _on_want(self) -> None:
        try:
            os.eventfd_read(self._want_fd)
        except BlockingIOError:
            return
        self._report()

    def _renew(self) -> None:
        assert self._loop is not None
        self._report()
        self._refresh = self._loop.call_later(self.refresh_s, self._renew)

    def _adopt(self) -> None:
        """Connections the thread handed over: each becomes one uvicorn connection."""
        assert self._loop is not None
        for fd in self._handed_over():
            conn = socket.socket(fileno=fd)
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as e:  # the client left between accept and now
            logger.debug("dropping a connection that went away: %s", e)
            conn.close()

    def stats(self) -> tuple[int, int, int]:
        """(connections accepted, health probes answered, handed to the loop)."""
        assert self._handle is not None
        return _acceptor.stats(self._handle)

    def close(self) -> None:
        """Stop accepting (joins the thread); connections already adopted live on.

        Idempotent."""
        if self.sock.fileno() < 0:
            return
        if self._refresh is not None:
            self._refresh.cancel()
        if self._handle is not None:
            _acceptor.stop(self._handle)
            self._handle = None
        if self._loop is not None:
            self._loop.remove_reader(self._read_fd)
            self._loop.remove_reader(self._want_fd)
            self._adopt_leftovers()
        for fd in (self._read_fd, self._write_fd, self._want_fd):
            os.close(fd)
        self.sock.close()

    async def wait_adopted(self) -> None:
        """Until every connection handed over has reached the protocol (uvicorn's shutdown
        sweep then sees it)."""
        if self._connecting:
            await asyncio.wait(list(self._connecting))

    def _adopt_leftovers(self) -> None:
        """Fds handed over but not yet adopted are closed: we are shutting down."""
        for fd in self._handed_over():
            os.close(fd)

    def _handed_over(self) -> list[int]:
        """Every fd number waiting in the pipe (4 bytes each; pipe writes that small are
        atomic, so a read of a multiple of 4 bytes never splits one)."""
        fds: list[int] = []
        while True:
            try:
                data = os.read(self._read_fd, 4 * 1024)
            except BlockingIOError:
                return fds
            if not data:
                return fds
            fds += [
                int.from_bytes(data[i : i + 4], sys.byteorder, signed=True)
                for i in range(0, len(data), 4)
            ]
