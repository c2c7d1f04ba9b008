"""Slow and idle clients: deadlines for a request's head and body, and caps on connections.

Found by a hostile probe of a launched server: connections that never finished their
headers or body stayed open forever, each holding a descriptor, and at the descriptor limit
the accept thread could not even take /health probes any more. Now:

* A request's head (request line and headers) must arrive within ``header_timeout_s`` of
  the connection being handed to the loop, or, on a kept-alive connection, of the next
  request's first byte; its body within ``body_timeout_s`` of the end of the head. Both are
  whole-phase deadlines, not gaps between reads, so a client trickling a byte at a time
  cannot stretch them. A client that misses one gets 408 (if no response has started) and
  is closed; the 408's body is in Anthropic's error shape when the request line that did
  arrive names a ``/v1/messages`` path, else in OpenAI's (``APIError.body_for``). Between requests uvicorn's ``timeout_keep_alive`` closes idle connections.
* At most ``max_connections_per_peer`` connections per client address, and at most
  ``max_connections`` in all; a connection beyond either gets 503 and is closed at once.
  ``max_connections`` defaults to the descriptor limit less a reserve for the accept
  thread's own connections in flight, so the accept thread can always take a health probe
  and answer it, whatever clients hold.

``TimedHttpProtocol`` is uvicorn's httptools protocol with these deadlines and caps; the
server builds one per connection the accept thread hands over (``frontend/http/server.py``).
Hooks used (uvicorn 0.29+): the parser callbacks ``on_message_begin``,
``on_headers_complete`` and ``on_message_complete``, and ``cycle`` (the request in flight).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import Counter
from http import HTTPStatus
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from frontend.errors import APIError
from frontend.settings import ConnectionLimits

logger = logging.getLogger(__name__)

# Descriptors kept back from connections: the accept thread may hold up to 1024 undecided
# connections (frontend/http/_acceptor.c, MAX_PENDING) plus what sits in its hand-off pipe.
FD_RESERVE = 1024 + 256


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to the hard one; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. above fs.nr_open: keep what we have
            pass
    return soft


def connection_budget(fd_limit: int, fds_open: int) -> int:
    """Connections the server may hold with ``fds_open`` descriptors already taken."""
    free = fd_limit - fds_open
    return max(16, free - min(FD_RESERVE, free // 2))


def fds_open() -> int:
    return len(os.listdir("/proc/self/fd"))


class ConnectionLimiter:
    """Open connections per peer address and in all; the event loop's only."""

    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.per_peer: Counter[str] = Counter()
        self.total = 0
        self.refused = 0
        self.timed_out = 0  # counted by the protocol
        self._next_log_at = 0.0

    def admit(self, peer: str) -> str | None:
        """Count a new connection from ``peer``; or the reason it is refused."""
        if self.total >= self.max_connections:
            reason = f"the server holds {self.total} connections (--max-connections)"
        elif self.max_per_peer and self.per_peer[peer] >= self.max_per_peer:
            reason = f"{peer} holds {self.per_peer[peer]} connections (--max-connections-per-peer)"
        else:
            self.per_peer[peer] += 1
            self.total += 1
            return None
        self.refused += 1
        now = time.monotonic()
        if now >= self._next_log_at:  # a flood must not flood the log too
            logger.warning("refusing connections: %s (%d refused so far)", reason, self.refused)
            self._next_log_at = now + 1.0
        return reason

    def stats(self) -> tuple[int, int, int]:
        """(connections held, refused, closed for a late head or body)."""
        return self.total, self.refused, self.timed_out

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]


def error_response(
    status: int, message: str, code: str, retry_after_s: int = 0, path: str = ""
) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, its error body in the shape of
    the API ``path`` belongs to (Anthropic's on ``/v1/messages...``, else OpenAI's)."""
    body = msgspec.json.encode(APIError(message, code=code, status=status).body_for(path))
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
    if retry_after_s:
        head += f"retry-after: {retry_after_s}\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines for a request's head and body, and the
    connection caps. At most one deadline is armed at a time: head, then body."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
        limiter: ConnectionLimiter,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits, self.limiter = limits, limiter
        self._deadline: asyncio.TimerHandle | None = None
        self._peer: str | None = None  # set while counted by the limiter

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else ""
        refused = self.limiter.admit(peer)
        if refused is not None:
            transport.write(
                error_response(
                    503, f"Too many connections: {refused}", "too_many_connections", retry_after_s=1
                )
            )
            transport.close()
            return
        self._peer = peer
        self._arm(self.limits.header_timeout_s, self._head_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._peer is not None:
            self.limiter.release(self._peer)
            self._peer = None
        super().connection_lost(exc)

    # -- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a kept-alive connection's next request: from its first byte
            self._arm(self.limits.header_timeout_s, self._head_late)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, self._body_late)  # until on_message_complete

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # no longer HTTP: the deadlines do not apply
        super().handle_websocket_upgrade()

    # -- deadlines ---------------------------------------------------------------------------

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A request head pipelined behind a response still being sent: its clock
            # starts once that response is done.
            self._arm(self.limits.header_timeout_s, self._head_late)
            return
        # ``cycle`` is still the previous request's (done) on a kept-alive connection.
        self._give_up("request head", self.limits.header_timeout_s, answer=True)

    def _body_late(self) -> None:
        self._deadline = None
        # A handler may have answered before reading the body (401, 413, 415): then the
        # client is only told by the close.
        answer = self.cycle is not None and not self.cycle.response_started
        self._give_up("request body", self.limits.body_timeout_s, answer)

    def _path(self) -> str:
        """The path of the request in flight as far as its head arrived ("" before its
        request line): the error's shape follows it. ``url`` is uvicorn's, reset by each
        request's ``on_message_begin`` and grown by ``on_url``."""
        url: bytes = getattr(self, "url", b"")
        return url.split(b"?", 1)[0].decode("latin-1")

    def _give_up(self, what: str, timeout_s: float, answer: bool) -> None:
        if self.transport.is_closing():
            return
        logger.info(
            "%s: %s not received within %g s; closing the connection", self._peer, what, timeout_s
        )
        self.limiter.timed_out += 1
        if answer:
            message = f"The {what} was not received within {timeout_s:g} s"
            self.transport.write(error_response(408, message, "request_timeout", path=self._path()))
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The handler waiting for the body sees a disconnect, and nothing it sends
            # from now on reaches the wire after our 408.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
