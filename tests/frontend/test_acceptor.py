"""The C accept thread: health probes answered off the loop, everything else handed over.

A real listening socket on loopback, a real event loop in a thread, and a minimal HTTP
protocol standing in for uvicorn: it answers every request it is handed with its path, so
a test can tell who answered (the acceptor's reply carries the health report instead).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from frontend.http.acceptor import HealthAcceptor


class _Echo(asyncio.Protocol):
    """Answers ``<METHOD> <path>`` once the headers are in, then closes."""

    def __init__(self) -> None:
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" in self.buf:
            line = self.buf.split(b"\r\n", 1)[0]
            body = b"loop saw " + line
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()


@dataclass
class Served:
    port: int
    loop: asyncio.AbstractEventLoop
    acceptor: HealthAcceptor
    report: dict[str, object]


@pytest.fixture
def served() -> Iterator[Served]:
    sock = socket.create_server(("127.0.0.1", 0))
    report: dict[str, object] = {"status": 200, "body": b'{"status":"ok"}'}
    acceptor = HealthAcceptor(
        sock,
        _Echo,
        lambda: (report["status"], report["body"]),  # type: ignore[arg-type,return-value]
        refresh_s=60.0,
        stale_s=0.3,  # only probes ask for reports
        peek_s=0.5,  # room for a client thread that waits for the GIL between connect and send
    )
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(lambda: (acceptor.start(), started.set()))
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(5)
    yield Served(sock.getsockname()[1], loop, acceptor, report)
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (acceptor.close(), done.set()))
    assert done.wait(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _ask(port: int, *parts: bytes, gap_s: float = 0.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for part in parts:
            s.sendall(part)
            time.sleep(gap_s)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_a_health_probe_gets_the_loop_s_report(served: Served) -> None:
    assert _ask(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") == (
        200,
        b'{"status":"ok"}',
    )
    assert _ask(served.port, b"GET /health?verbose=1 HTTP/1.1\r\n\r\n")[0] == 200
    # The probe asks the loop for a fresh report: a change shows at once.
    served.report.update(status=503, body=b'{"status":"degraded"}')
    assert _ask(served.port, b"GET /health HTTP/1.1\r\n\r\n") == (503, b'{"status":"degraded"}')
    accepted, answered, handed_over = served.acceptor.stats()
    assert (accepted, answered, handed_over) == (3, 3, 0)


def test_a_probe_split_over_several_segments_is_still_answered_here(served: Served) -> None:
    status, body = _ask(served.port, b"GET /hea", b"lth HTTP/1.1\r\n", b"\r\n", gap_s=0.01)
    assert (status, body) == (200, b'{"status":"ok"}')


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET / HTTP/1.1",
        b"GET /healthz HTTP/1.1",
        b"POST /health HTTP/1.1",
        b"GET /v1/models HTTP/1.1",
    ],
)
def test_every_other_request_reaches_the_loop_untouched(
    served: Served, request_line: bytes
) -> None:
    status, body = _ask(served.port, request_line + b"\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, b"loop saw " + request_line)


def test_a_silent_connection_goes_to_the_loop_after_the_peek_window(served: Served) -> None:
    started = time.monotonic()
    gap_s = 3 * served.acceptor.peek_s
    status, body = _ask(served.port, b"", b"GET /health HTTP/1.1\r\n\r\n", gap_s=gap_s)
    assert (status, body) == (200, b"loop saw GET /health HTTP/1.1")
    assert served.acceptor.stats()[2] == 1 and time.monotonic() - started < 5


def test_a_stalled_loop_turns_probes_into_503_then_back(served: Served) -> None:
    blocked = threading.Event()
    served.loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(0.8)))
    assert blocked.wait(5)
    time.sleep(0.5)  # the last report is now older than stale_s (0.3 s)
    status, body = _ask(served.port, b"GET /health HTTP/1.1\r\n\r\n")
    assert status == 503 and json.loads(body)["status"] == "unresponsive"
    time.sleep(0.6)  # the loop runs again: the next probe's report is fresh
    assert _ask(served.port, b"GET /health HTTP/1.1\r\n\r\n")[0] == 200


def test_after_close_nothing_is_accepted(served: Served) -> None:
    done = threading.Event()
    served.loop.call_soon_threadsafe(lambda: (served.acceptor.close(), done.set()))
    assert done.wait(5)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", served.port), timeout=2)


def test_a_burst_of_mixed_connections_is_answered_by_the_right_side(served: Served) -> None:
    from concurrent.futures import ThreadPoolExecutor

    lines = [
        b"GET /health HTTP/1.1" if i % 3 == 0 else b"GET /r%d HTTP/1.1" % i for i in range(300)
    ]
    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(lambda line: _ask(served.port, line + b"\r\n\r\n"), lines))
    for line, reply in zip(lines, replies, strict=True):
        want = b'{"status":"ok"}' if line.startswith(b"GET /health") else b"loop saw " + line
        assert reply == (200, want)
    assert served.acceptor.stats() == (300, 100, 200)


def test_a_probe_with_a_body_or_a_pipelined_request_goes_to_the_loop(served: Served) -> None:
    """Answering here would leave those bytes unread: close() would then reset the connection."""
    for request in (
        b"GET /health HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
        b"GET /health HTTP/1.1\r\n\r\nGET /x HTTP/1.1\r\n\r\n",
    ):
        assert _ask(served.port, request) == (200, b"loop saw GET /health HTTP/1.1")
    assert served.acceptor.stats()[1:] == (0, 2)


def test_close_returns_while_the_handoff_pipe_is_full(served: Served) -> None:
    import fcntl
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        if hard != resource.RLIM_INFINITY and hard < 4096:
            pytest.skip(f"needs ~2,300 open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))

    fcntl.fcntl(served.acceptor._write_fd, fcntl.F_SETPIPE_SZ, 4096)  # room for 1024 fds
    blocked, filled, closed = threading.Event(), threading.Event(), threading.Event()

    def stall_then_close() -> None:
        blocked.set()
        filled.wait(10)  # meanwhile the pipe fills: nobody adopts
        served.acceptor.close()
        closed.set()

    served.loop.call_soon_threadsafe(stall_then_close)
    assert blocked.wait(5)
    conns = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(1100)]
    for c in conns:
        c.sendall(b"GET / HTTP/1.1\r\n\r\n")
    time.sleep(0.2)  # past the peek window: the thread now waits on a full pipe
    filled.set()
    try:
        assert closed.wait(5)
    finally:
        for c in conns:
            c.close()
