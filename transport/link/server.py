"""The listening end of a link: a ROUTER bound to one address, many clients."""

from __future__ import annotations

import time
from dataclasses import dataclass

from transport.errors import LinkError, PeerRefused
from transport.link.auth import ZAP_DOMAIN, Guard, logger
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


@dataclass(slots=True)
class PeerInfo:
    """A client the server has greeted, keyed by its ZeroMQ routing id."""

    identity: bytes
    hello: Hello
    last_heard: float  # time.monotonic()
    last_beat: int = 0


class LinkServer(LinkEndpoint):
    """The listening side: a ROUTER bound to one address, many clients.

    ``address`` is host:port with an explicit host (port 0 picks a free port; ``endpoint``
    is what was bound). ``recv`` returns ``(peer, record)``, ``peer`` being the client's
    routing id that ``send`` takes back.
    """

    def _open(self, host: str, port: int) -> None:
        zmq = self._zmq
        self._peers: dict[bytes, PeerInfo] = {}
        # The ZAP handler binds before the ROUTER does: libzmq admits every CURVE client
        # while no handler is bound, so the reverse order would leave a window open.
        try:
            self._guard = Guard(zmq, self._ctx, self._public)
        except BaseException:
            self._ctx.term()
            raise
        try:
            self._sock = self._socket(zmq.ROUTER)
            # A send to a client that left raises (PeerGone) instead of vanishing.
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.curve_server = True
            self._sock.curve_secretkey = self._secret
            self._sock.curve_publickey = self._public
            self._sock.zap_domain = ZAP_DOMAIN.encode()
            self._guard.start(self._sock.get_monitor_socket())
            self._sock.bind(tcp_endpoint(host, port or "*"))
        except BaseException:
            self.close()
            raise
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = (bound.decode() if isinstance(bound, bytes) else str(bound))[6:]
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    @property
    def peers(self) -> dict[bytes, PeerInfo]:
        """Greeted clients by routing id (a copy)."""
        return dict(self._peers)

    def wait(self, fds: list[int], timeout: float) -> None:
        """Sleep until a message is waiting, one of ``fds`` is readable, or ``timeout``
        passes: lets an owner with rings of its own sleep on both without spinning."""
        wait_any(self._zmq, [self._sock], fds, timeout)

    def recv(self, timeout: float) -> tuple[bytes, Record | LinkRecord] | None:
        """The next application record and its sender, or None after ``timeout`` seconds.

        Hellos (answered), beats and bad frames are handled here and not returned.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if not self._poller.poll(max(0.0, remaining) * 1000):
                return None
            got = self._handle(self._sock.recv_multipart())
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                return None

    def _handle(self, frames: list[bytes]) -> tuple[bytes, Record | LinkRecord] | None:
        peer = frames[0]
        msg = self._decode(frames[1:], f"peer {peer.hex()}")
        if msg is None:
            return None
        now = time.monotonic()
        if isinstance(msg, Hello):
            try:
                check_version(msg, "client")
            except PeerRefused as e:
                logger.warning("link %s: refused peer %s: %s", self.node, peer.hex(), e)
                self._peers.pop(peer, None)
            else:
                self._peers[peer] = PeerInfo(peer, msg, now)
            # Answered even on a version mismatch: the client then refuses us clearly
            # instead of timing out.
            self._send_frames([peer, *encode_link(self._hello)], 1.0, quiet=True)
            return None
        known = self._peers.get(peer)
        if known is None:
            self.bad_frames += 1
            logger.warning(
                "link %s: dropped a %s from peer %s, which has not said Hello",
                self.node,
                type(msg).__name__,
                peer.hex(),
            )
            return None
        known.last_heard = now
        if isinstance(msg, Beat):
            known.last_beat = msg.seq
            return None
        return peer, msg

    def send(self, peer: bytes, msg: Record, timeout: float = 1.0) -> None:
        """Send one record to ``peer``; PeerGone if it is not connected, LinkTimeout if full."""
        self._send_frames([peer, records.encode(msg)], timeout)

    def send_link(self, peer: bytes, msg: LinkRecord, timeout: float = 1.0) -> None:
        """Send one of the link's owner records to ``peer`` (errors as ``send``)."""
        self._send_frames([peer, *encode_link(msg)], timeout)

    def _send_frames(self, frames: list[bytes], timeout: float, quiet: bool = False) -> None:
        try:
            send(self._sock, self._zmq, frames, timeout)
        except LinkError as e:
            if not quiet:
                raise
            logger.warning("link %s: could not answer peer %s: %s", self.node, frames[0].hex(), e)

    def send_beat(self, timeout: float = 0.1) -> list[bytes]:
        """A Beat to every greeted peer; returns the peers it could not reach."""
        beat = self._next_beat()
        failed = []
        for peer in list(self._peers):
            try:
                send(self._sock, self._zmq, [peer, *beat], timeout)
            except LinkError:
                failed.append(peer)
        return failed

    def silent_peers(self, after_s: float) -> list[bytes]:
        """Greeted peers not heard from within the last ``after_s`` seconds."""
        cutoff = time.monotonic() - after_s
        return [p.identity for p in self._peers.values() if p.last_heard < cutoff]

    def forget(self, peer: bytes) -> None:
        """Stop tracking ``peer`` (it must say Hello again to be heard)."""
        self._peers.pop(peer, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()
        # The ROUTER is closed first so that no handshake can reach a stopped ZAP handler.
        if self._guard.stop():
            self._ctx.term()
        else:
            logger.warning("link %s: guard thread did not stop; leaving its context", self.node)
