"""The connecting end of a link: one DEALER to one server."""

from __future__ import annotations

import time

from transport.errors import LinkError, LinkTimeout, PeerRefused
from transport.link.auth import event_name, logger
from transport.link.endpoint import (
    LinkEndpoint,
    Record,
    check_version,
    send,
    tcp_endpoint,
    wait_any,
)
from wire import records
from wire.link_records import Beat, Hello, LinkRecord, encode_link


class LinkClient(LinkEndpoint):
    """The connecting side: one DEALER to one server's ``address`` (host:port)."""

    def _open(self, host: str, port: int) -> None:
        zmq = self._zmq
        self._endpoint = tcp_endpoint(host, port)
        self.server: Hello | None = None
        self._last_heard = 0.0
        self._last_beat = 0
        self._sock = self._socket(zmq.DEALER)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # The server's key is the cluster's public key, and so is ours (see auth).
        self._sock.curve_serverkey = self._public
        self._sock.curve_publickey = self._public
        self._sock.curve_secretkey = self._secret
        self._monitor = self._sock.get_monitor_socket()
        self._handshakes = 0
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def connect(self, timeout: float) -> Hello:
        """Connect and exchange Hellos; the server's Hello, or PeerRefused / LinkTimeout."""
        if self.server is not None:
            return self.server
        deadline = time.monotonic() + timeout
        self._sock.connect(self._endpoint)
        # Queued on the pipe until the handshake completes (ZMQ_IMMEDIATE is off).
        send(self._sock, self._zmq, encode_link(self._hello), max(0.0, timeout))
        while self.server is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                what = "no Hello" if self._handshakes else "no CURVE handshake"
                raise LinkTimeout(f"{what} from {self._endpoint} within {timeout:.3g}s")
            self._poll_once(remaining, refuse=True)
        return self.server

    @property
    def handshakes(self) -> int:
        """CURVE handshakes completed so far: one per connection to the server, so more
        than one means the link reconnected (and greeted the server again)."""
        return self._handshakes

    def _poll_once(self, timeout: float, refuse: bool) -> Record | LinkRecord | None:
        ready = dict(self._poller.poll(max(0.0, timeout) * 1000))
        if self._monitor in ready:
            self._on_event(refuse)
        if self._sock in ready:
            return self._handle(self._sock.recv_multipart())
        return None

    def _on_event(self, refuse: bool) -> None:
        zmq = self._zmq
        event = zmq.utils.monitor.recv_monitor_message(self._monitor)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshakes += 1
            if self._handshakes > 1 and self.server is not None:
                # A new connection may reach a restarted server that never heard us.
                send(self._sock, zmq, encode_link(self._hello), 0.1)
            return
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"the server refused our key (ZAP status {value})"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = f"CURVE handshake failed ({event_name(zmq, 'PROTOCOL_ERROR_', value)})"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # What a wrong key looks like from here: the server cannot open our handshake
            # and drops the connection without a word.
            why = "the server closed the connection during the CURVE handshake"
        else:
            return
        message = f"{self._endpoint}: {why}; is --cluster-key the same on both nodes?"
        if refuse:
            raise PeerRefused(message)
        logger.warning("link %s: %s", self.node, message)

    def _handle(self, frames: list[bytes]) -> Record | LinkRecord | None:
        msg = self._decode(frames, "the server")
        if msg is None:
            return None
        self._last_heard = time.monotonic()
        if isinstance(msg, Hello):
            check_version(msg, "server")
            self.server = msg
            return None
        if isinstance(msg, Beat):
            self._last_beat = msg.seq
            return None
        return msg

    def _require_hello(self) -> None:
        if self.server is None:
            raise LinkError("connect() first: the server has not answered Hello")

    def send(self, msg: Record, timeout: float = 1.0) -> None:
        """Send one record to the server; LinkTimeout if it cannot be queued in time."""
        self._require_hello()
        send(self._sock, self._zmq, [records.encode(msg)], timeout)

    def send_link(self, msg: LinkRecord, timeout: float = 1.0) -> None:
        """Send one of the link's owner records to the server (errors as ``send``)."""
        self._require_hello()
        send(self._sock, self._zmq, encode_link(msg), timeout)

    def wait(self, fds: list[int], timeout: float) -> None:
        """As ``LinkServer.wait``."""
        wait_any(self._zmq, [self._sock, self._monitor], fds, timeout)

    def recv(self, timeout: float) -> Record | LinkRecord | None:
        """The next application record from the server, or None after ``timeout`` seconds."""
        self._require_hello()
        deadline = time.monotonic() + timeout
        while True:
            got = self._poll_once(deadline - time.monotonic(), refuse=False)
            if got is not None or time.monotonic() >= deadline:
                return got

    def send_beat(self, timeout: float = 0.1) -> None:
        self._require_hello()
        send(self._sock, self._zmq, self._next_beat(), timeout)

    def silent_peers(self, after_s: float) -> list[str]:
        """``[server node]`` if the server was not heard within ``after_s`` seconds, else []."""
        if self.server is None:
            return []
        return [self.server.node] if self._last_heard < time.monotonic() - after_s else []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        self._ctx.term()
