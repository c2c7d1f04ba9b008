"""What both ends of a link do alike: the socket options, one frame per record, sends
that time out instead of blocking, and the checks on what arrives.

``LinkEndpoint`` holds the set-up the server and the client share (keys, context, Hello,
counters); each end adds its socket and its way of knowing its peers.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Self

import msgspec

from transport.errors import BadFrame, LinkError, LinkTimeout, PeerGone, PeerRefused
from transport.link.auth import cluster_keypair, logger, zmq_module
from wire import records
from wire.link_records import (
    LINK_TAG,
    LINK_VERSION,
    Beat,
    Hello,
    LinkRecord,
    decode_link,
    encode_link,
)
from wire.records import Control, TokenBatch

if TYPE_CHECKING:
    import zmq

Record = Control | TokenBatch


class LinkEndpoint:
    """One end of a link: its node name, its Hello, its keys and its ZeroMQ context.

    A link object belongs to one thread. ``bad_frames`` counts messages dropped as
    undecodable or out of turn; ``close`` is idempotent.
    """

    # Records queued per peer before a send waits (and times out), and the largest frame
    # taken: an authenticated peer is trusted, but a corrupted length must not allocate GBs.
    SNDHWM = 4096
    MAX_RECORD_BYTES = 64 << 20

    def __init__(self, address: str, cluster_key: str, node: str, info: bytes = b"") -> None:
        host, port = split_address(address)
        self._zmq = zmq_module()
        self._public, self._secret = cluster_keypair(cluster_key)
        self.node = node
        self._hello = Hello(node, LINK_VERSION, info)
        self._beats = 0
        self.bad_frames = 0
        self._closed = False
        self._ctx = self._zmq.Context()
        self._open(host, port)

    def _open(self, host: str, port: int) -> None:
        """Create, secure and bind or connect this end's socket."""
        raise NotImplementedError

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        zmq = self._zmq
        sock = self._ctx.socket(kind)
        # Small linger: close() must not hang on a peer that went away with records queued.
        sock.setsockopt(zmq.LINGER, 100)
        sock.setsockopt(zmq.SNDHWM, self.SNDHWM)
        sock.setsockopt(zmq.RCVHWM, self.SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.MAX_RECORD_BYTES)
        # A half-open handshake (a stalled or hostile peer) is dropped after this.
        sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        # ZMTP pings: ZeroMQ itself notices a dead TCP peer (a cable, a frozen host) and
        # drops the connection, which our last_heard alone would only report.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)
        return sock

    def _next_beat(self) -> list[bytes]:
        self._beats += 1
        return encode_link(Beat(self.node, self._beats))

    def _decode(
        self, frames: list[bytes], sender: str
    ) -> Hello | Beat | Record | LinkRecord | None:
        """The record in a message's frames (routing id removed), or None: a bad frame,
        logged and counted."""
        try:
            return decode_body(frames)
        except BadFrame as e:
            self.bad_frames += 1
            logger.warning("link %s: dropped a message from %s: %s", self.node, sender, e)
            return None

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or tcp://host:port, [v6]:port) -> (host, port)."""
    bare = address.removeprefix("tcp://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"link address {address!r} is not host:port")
    if host == "*":
        raise ValueError(f"link address {address!r}: name the interface (0.0.0.0 for all)")
    return host, int(port)


def tcp_endpoint(host: str, port: int | str) -> str:
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{bracketed}:{port}"


def decode_body(frames: list[bytes]) -> Hello | Beat | Record | LinkRecord:
    """The record in a message's frames (routing id removed), or BadFrame."""
    try:
        if len(frames) == 1:
            return records.decode(frames[0])
        if len(frames) == 2 and frames[0] == LINK_TAG:
            return decode_link(frames[1])
    except (records.RecordError, msgspec.DecodeError, ValueError, IndexError) as e:
        # ValueError/IndexError: a truncated TokenBatch header fails inside struct/numpy.
        raise BadFrame(f"undecodable record ({len(frames[-1])} bytes): {e}") from e
    except Exception as e:  # struct.error and friends: still only this message is bad
        raise BadFrame(f"undecodable record: {type(e).__name__}: {e}") from e
    raise BadFrame(f"unexpected message of {len(frames)} frames")


def send(sock: zmq.Socket[Any], zmq: ModuleType, frames: list[bytes], timeout: float) -> None:
    sock.setsockopt(zmq.SNDTIMEO, max(0, int(timeout * 1000)))
    try:
        sock.send_multipart(frames, copy=False)
    except zmq.Again as e:
        raise LinkTimeout(f"send did not finish in {timeout:.3g}s: the peer is not reading") from e
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            raise PeerGone("the peer is not connected") from e
        raise LinkError(f"send failed: {e}") from e


def wait_any(zmq: ModuleType, socks: list[Any], fds: list[int], timeout: float) -> None:
    """Sleep until one of ``socks`` has a message, one of ``fds`` is readable, or
    ``timeout`` passes."""
    poller = zmq.Poller()
    for item in [*socks, *fds]:
        poller.register(item, zmq.POLLIN)
    poller.poll(max(0.0, timeout) * 1000)


def check_version(hello: Hello, who: str) -> None:
    if hello.version != LINK_VERSION:
        raise PeerRefused(
            f"{who} {hello.node!r} speaks link version {hello.version}, we speak {LINK_VERSION}"
        )
