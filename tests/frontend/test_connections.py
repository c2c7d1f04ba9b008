"""Slow and idle clients are closed after their deadline; connections are capped per peer.

A real uvicorn server on loopback running ``TimedHttpProtocol`` with short deadlines, over
the app and the reference engine. (On the launched server, with the accept thread in front
and /health probed throughout: tests/e2e/test_hostile_clients.py.)
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from frontend.http.app import build_app
from frontend.http.connections import ConnectionLimiter, TimedHttpProtocol, connection_budget
from frontend.settings import ConnectionLimits
from tests.frontend.conftest import make_settings

LIMITS = ConnectionLimits(
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    keep_alive_timeout_s=0.5,
    max_connections=1000,
    max_connections_per_peer=4,
)
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    b"content-type: application/json\r\ncontent-length: 40\r\n\r\n"
)


class Server:
    def __init__(self, app: Any, limits: ConnectionLimits) -> None:
        self.limiter = ConnectionLimiter(limits.max_connections, limits.max_connections_per_peer)
        http = functools.partial(TimedHttpProtocol, limits=limits, limiter=self.limiter)
        # uvicorn calls ``http`` as a class: a partial binding the limits works as one.
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            http=http,  # type: ignore[arg-type]
            timeout_keep_alive=limits.keep_alive_timeout_s,
        )  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server(make_client: Callable[..., Any]) -> Iterator[Server]:
    engine = make_client(step_delay_s=0.05)
    srv = Server(build_app(engine, engine.tokenizer, make_settings()), LIMITS)
    yield srv
    srv.stop()


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data, time.monotonic()


def assert_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_client_that_sends_nothing_is_closed_after_the_head_deadline(server: Server) -> None:
    with server.connect() as s:
        t0 = time.monotonic()
        data, closed = read_until_closed(s)
    assert_408(data)
    assert 0.4 < closed - t0 < 2.0


def test_a_head_trickled_byte_by_byte_is_still_timed_out(server: Server) -> None:
    with server.connect() as s:
        t0 = time.monotonic()
        for byte in HEAD[:30]:  # each byte well inside the deadline, the head far beyond it
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
        data, closed = read_until_closed(s)
    assert_408(data)
    assert closed - t0 < 2.0


def test_the_next_request_on_a_kept_alive_connection_has_its_own_head_deadline(
    server: Server,
) -> None:
    with server.connect() as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /v1/mo")  # the next head starts, and never ends
        data, _ = read_until_closed(s)
    assert_408(data)


def test_a_body_that_stops_coming_is_closed_after_the_body_deadline(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with server.connect() as s:
        s.sendall(HEAD + b'{"prompt": "')
        t0 = time.monotonic()
        data, closed = read_until_closed(s)
    assert_408(data)
    assert 0.4 < closed - t0 < 2.0
    assert server.limiter.stats()[2] >= 1  # counted for /metrics
    # The handler saw a disconnect: quiet, no 500, no traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


def test_a_late_head_or_body_on_anthropic_paths_gets_anthropic_s_408(server: Server) -> None:
    """Once the request line names an Anthropic path, its 408 is in Anthropic's shape."""
    late_body = HEAD.replace(b"/v1/completions", b"/v1/messages/count_tokens") + b'{"mo'
    for sent in (b"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\n", late_body):
        with server.connect() as s:
            s.sendall(sent)
            data, _ = read_until_closed(s)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), data
        payload = json.loads(body)
        assert payload["type"] == "error" and payload["error"]["type"] == "timeout_error"
        assert payload["error"]["message"].endswith("was not received within 0.5 s")


def test_an_idle_kept_alive_connection_is_closed(server: Server) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:
        assert http.get("/v1/models").status_code == 200
        time.sleep(0.2)  # within keep-alive: the same connection serves the next request
        assert http.get("/v1/models").status_code == 200
    with server.connect() as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        t0 = time.monotonic()
        data, closed = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 ") and b"408" not in data.split(b"\r\n")[0]
    assert 0.4 < closed - t0 < 2.0


def test_a_response_slower_than_the_deadlines_is_not_cut(server: Server) -> None:
    # ~40 tokens at 50 ms: far past the 0.5 s deadlines, which cover reading only.
    body = {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={**body, "stream": stream})
            assert r.status_code == 200 and r.text.count("error") == 0, r.text


def test_connections_beyond_the_per_peer_cap_get_503(server: Server) -> None:
    held = [server.connect() for _ in range(LIMITS.max_connections_per_peer)]
    deadline = time.monotonic() + 2
    while server.limiter.total < len(held) and time.monotonic() < deadline:
        time.sleep(0.01)
    with server.connect() as extra:
        data, _ = read_until_closed(extra)
    assert data.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in data
    held.pop().close()
    time.sleep(0.1)
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:  # room again
        assert http.get("/v1/models").status_code == 200
    for s in held:
        s.close()


def test_the_limiter_counts_per_peer_and_in_all() -> None:
    limiter = ConnectionLimiter(max_connections=3, max_per_peer=2)
    assert limiter.admit("a") is None and limiter.admit("a") is None
    assert "per-peer" in (limiter.admit("a") or "")
    assert limiter.admit("b") is None
    assert "--max-connections" in (limiter.admit("c") or "")
    limiter.release("a")
    assert limiter.admit("c") is None
    assert dict(limiter.per_peer) == {"a": 1, "b": 1, "c": 1}
    assert limiter.stats() == (3, 2, 0)


def test_the_connection_budget_keeps_descriptors_back() -> None:
    assert connection_budget(65536, 100) == 65536 - 100 - 1280
    assert connection_budget(1024, 100) == 1024 - 100 - 462  # half of what is left
    assert connection_budget(64, 60) == 16  # never nothing
