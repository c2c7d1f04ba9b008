"""A record channel between nodes on different hosts: ZeroMQ over TCP, CURVE-encrypted.

On one host the processes talk through shared-memory rings; across hosts the same
records (``wire.records``: ``Control`` structs and ``TokenBatch``) travel on a ROUTER
(``LinkServer``, one per listening node) / DEALER (``LinkClient``, one per connection)
pair. Nothing is pickled: a frame is data that ``wire.records.decode`` validates.

Authentication from one shared string
    Every node is started with the same ``--cluster-key``. ``cluster_keypair`` stretches
    it (scrypt, a fixed salt) into a CURVE secret key, so every node derives the same
    keypair without any key file to distribute. The server runs ``curve_server`` with that
    secret; a client names the derived public key as the server's key and presents the
    same pair as its own. That makes the check mutual:

    * a client with another key encrypts its handshake to a server key that does not
      exist, so the server cannot open it and drops the connection (the client sees the
      handshake fail; the server's monitor sees a cryptographic protocol error);
    * a client that knows only the public key (it is not secret: it can leak from a log
      or a config dump) completes the CURVE handshake with a keypair of its own, but the
      server's ZAP handler admits no client key other than the cluster's, and CURVE makes
      a client prove it holds the secret of the key it presents.

    The stretching matters because one recorded handshake lets an eavesdropper test key
    guesses offline; keys shorter than 16 characters are refused outright.

What a refusal looks like
    On the server, each refused connection is one WARNING on the ``transport.cluster_link``
    logger with the peer's address: from the ZAP handler (wrong client key) or from the
    socket monitor (handshake failed: wrong key, not CURVE, or closed mid-handshake). A
    monitor event names no peer address, so that address is the one read from the socket
    when the connection was accepted (best effort: "unknown" if it was closed already). On the client, ``connect`` watches its own socket
    monitor and raises ``PeerRefused`` on the first failed handshake instead of waiting
    out its timeout; no answer at all is ``LinkTimeout``.

Framing
    An application record is exactly one frame, ``wire.records.encode(msg)``, so the hot
    path (a ``TokenBatch`` per engine step) costs no extra frame. The link's own records
    (``Hello``, ``Beat``, and ``Relay``/``Rows`` that a node's gateway uses) are two frames, ``[LINK_TAG, msgpack]``, so they need no kind byte
    in ``wire.records``' space. The ROUTER side adds the peer's routing id in front, as
    ZeroMQ does. Anything else (a frame that does not decode, a wrong frame count, a
    record from a peer that has not said Hello) is logged as ``BadFrame``, counted in
    ``bad_frames`` and dropped; the link carries on.

Liveness
    A client sends ``Hello`` on connect and the server answers with its own; only then does
    it accept the client's records. Either side may ``send_beat``; every message heard
    (beats included) refreshes the sender's ``last_heard``, and ``silent_peers(after_s)``
    lists the peers not heard within ``after_s``. ZMTP heartbeats are also on, so ZeroMQ
    itself drops a dead TCP connection and a send to it raises ``PeerGone``. Liveness is
    updated by ``recv``: the owner is expected to call it regularly. A client that
    reconnects (its server restarted, or ZeroMQ dropped a dead connection) gets a new
    routing id on the server, so it says Hello again and is a new peer there; the old
    entry goes silent and the owner ``forget``s it.

Threads: a link object belongs to one thread. The server runs one guard thread of its
own, which owns only the ZAP and monitor sockets; ``close`` stops it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec

from transport.errors import (
    BadFrame,
    ClusterUnavailable,
    LinkError,
    LinkTimeout,
    PeerGone,
    PeerRefused,
)
from wire import records
from wire.records import Control, TokenBatch

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

LINK_VERSION = 1
LINK_TAG = b"pdserve.link"  # first frame of the link's own records
MIN_KEY_CHARS = 16
# scrypt's cost, fixed for ever: every node must derive the same key. About 50 ms once
# per link object, and 16 MiB; a guess costs an attacker the same.
_KDF_SALT = b"pdserve cluster link / CURVE v1"
_KDF_N, _KDF_R, _KDF_P = 2**14, 8, 1
_ZAP_DOMAIN = "pdserve.cluster"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ's ZAP specification

Record = Control | TokenBatch


class _LinkMsg(msgspec.Struct, array_like=True, tag_field="k", frozen=True):
    pass


class Hello(_LinkMsg, tag="hello", frozen=True):
    """First record each way: who is there. ``info`` is opaque to the link (KV layouts)."""

    node: str
    version: int
    info: bytes


class Beat(_LinkMsg, tag="beat", frozen=True):
    """A heartbeat; ``seq`` counts the sender's beats, from 1."""

    node: str
    seq: int


class Relay(_LinkMsg, tag="relay", frozen=True):
    """A ring record crossing hosts: ``payload`` is the record's bytes as the ring holds
    them (``wire.records.encode``), ``ring`` the ring's name (``wire.ring_names``). The
    receiving node's gateway checks both before it writes the payload into that ring."""

    ring: str
    payload: bytes


class Rows(_LinkMsg, tag="rows", frozen=True):
    """A node's engine workers' load-table rows, sent with every heartbeat: each row's
    fields by name (``LoadRow``), plus ``age_ns``, how old its heartbeat was when sent,
    since monotonic clocks mean nothing across hosts."""

    node: str
    rows: list[dict[str, int]]


class Join(_LinkMsg, tag="join", frozen=True):
    """A member node asks the head for rows and rings for its ``decode`` workers; ``layout``
    (``KVLayout.to_json()``) and ``model`` must match the head's or it is refused.
    ``base``: the first index of the workers the node already runs (a join again, after
    the head's gateway restarted), which the head must give back; -1 at first."""

    node: str
    decode: int
    layout: str
    model: str
    base: int = -1


class Welcome(_LinkMsg, tag="welcome", frozen=True):
    """The head's answer to ``Join``: the member's first decode index and the cluster's
    shape (JSON), or ``refused`` saying why (then nothing else is set)."""

    base: int
    shape: str
    refused: str = ""


LinkRecord = Relay | Rows | Join | Welcome  # handled by the link's owner (not Hello/Beat)

_link_encoder = msgspec.msgpack.Encoder()
_link_decoder = msgspec.msgpack.Decoder(Hello | Beat | Relay | Rows | Join | Welcome)


@dataclass(slots=True)
class PeerInfo:
    """A client the server has greeted, keyed by its ZeroMQ routing id."""

    identity: bytes
    hello: Hello
    last_heard: float  # time.monotonic()
    last_beat: int = 0


def _zmq() -> ModuleType:
    """The zmq module, or ``ClusterUnavailable`` saying how to get it."""
    try:
        import zmq
        import zmq.utils.monitor
        import zmq.utils.z85
    except ImportError as e:
        raise ClusterUnavailable(
            "multi-host links need pyzmq, which is not installed: pip install 'pdserve[nixl]'"
        ) from e
    if not zmq.has("curve"):
        raise ClusterUnavailable(
            f"this pyzmq (libzmq {zmq.zmq_version()}) is built without CURVE: "
            "reinstall it from a wheel with pip install 'pdserve[nixl]'"
        )
    return zmq


def check_cluster_key(key: str) -> None:
    """ValueError unless ``key`` is usable as a cluster key."""
    if not key:
        raise ValueError("the cluster key is empty: pass the same --cluster-key to every node")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(
            f"the cluster key has {len(key)} characters; it needs at least {MIN_KEY_CHARS} "
            "(a short key can be guessed offline from one recorded handshake)"
        )


def cluster_keypair(key: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys, Z85-encoded, that every node derives from ``key``."""
    check_cluster_key(key)
    return _derive(key)


@functools.lru_cache(maxsize=4)
def _derive(key: str) -> tuple[bytes, bytes]:
    zmq = _zmq()
    raw = hashlib.scrypt(key.encode(), salt=_KDF_SALT, n=_KDF_N, r=_KDF_R, p=_KDF_P, dklen=32)
    secret = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret), secret


def _split_address(address: str) -> tuple[str, int]:
    """'host:port' (or tcp://host:port, [v6]:port) -> (host, port)."""
    bare = address.removeprefix("tcp://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"link address {address!r} is not host:port")
    if host == "*":
        raise ValueError(f"link address {address!r}: name the interface (0.0.0.0 for all)")
    return host, int(port)


def _tune(sock: zmq.Socket[Any], zmq: ModuleType, sndhwm: int, max_bytes: int) -> None:
    # Small linger: close() must not hang on a peer that went away with records queued.
    sock.setsockopt(zmq.LINGER, 100)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, sndhwm)
    # An authenticated peer is trusted, but a corrupted length must not allocate gigabytes.
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    # A half-open handshake (a stalled or hostile peer) is dropped after this.
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    # ZMTP pings: ZeroMQ itself notices a dead TCP peer (a cable, a frozen host) and
    # drops the connection, which our last_heard alone would only report.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)


def _encode_link(msg: Hello | Beat | LinkRecord) -> list[bytes]:
    return [LINK_TAG, _link_encoder.encode(msg)]


def _decode_body(frames: list[bytes]) -> Hello | Beat | Record | LinkRecord:
    """The record in a message's frames (routing id removed), or BadFrame."""
    try:
        if len(frames) == 1:
            return records.decode(frames[0])
        if len(frames) == 2 and frames[0] == LINK_TAG:
            return _link_decoder.decode(frames[1])
    except (records.RecordError, msgspec.DecodeError, ValueError, IndexError) as e:
        # ValueError/IndexError: a truncated TokenBatch header fails inside struct/numpy.
        raise BadFrame(f"undecodable record ({len(frames[-1])} bytes): {e}") from e
    except Exception as e:  # struct.error and friends: still only this message is bad
        raise BadFrame(f"undecodable record: {type(e).__name__}: {e}") from e
    raise BadFrame(f"unexpected message of {len(frames)} frames")


def _send(sock: zmq.Socket[Any], zmq: ModuleType, frames: list[bytes], timeout: float) -> None:
    sock.setsockopt(zmq.SNDTIMEO, max(0, int(timeout * 1000)))
    try:
        sock.send_multipart(frames, copy=False)
    except zmq.Again as e:
        raise LinkTimeout(f"send did not finish in {timeout:.3g}s: the peer is not reading") from e
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:
            raise PeerGone("the peer is not connected") from e
        raise LinkError(f"send failed: {e}") from e


def _wait_any(zmq: ModuleType, socks: list[Any], fds: list[int], timeout: float) -> None:
    poller = zmq.Poller()
    for item in [*socks, *fds]:
        poller.register(item, zmq.POLLIN)
    poller.poll(max(0.0, timeout) * 1000)


def _check_version(hello: Hello, who: str) -> None:
    if hello.version != LINK_VERSION:
        raise PeerRefused(
            f"{who} {hello.node!r} speaks link version {hello.version}, we speak {LINK_VERSION}"
        )


def _event_name(zmq: ModuleType, prefix: str, value: int) -> str:
    names = [n for n in dir(zmq) if n.startswith(prefix) and getattr(zmq, n) == value]
    return names[0].removeprefix(prefix).lower() if names else str(value)


class LinkServer:
    """The listening side: a ROUTER bound to one address, many clients.

    ``address`` is host:port with an explicit host (port 0 picks a free port; ``endpoint``
    is what was bound). ``recv`` returns ``(peer, record)``, ``peer`` being the client's
    routing id that ``send`` takes back.
    """

    def __init__(
        self,
        address: str,
        cluster_key: str,
        node: str,
        info: bytes = b"",
        *,
        sndhwm: int = 4096,
        max_record_bytes: int = 64 << 20,
    ) -> None:
        self._zmq = zmq = _zmq()
        public, secret = cluster_keypair(cluster_key)
        host, port = _split_address(address)
        self.node = node
        self._hello = Hello(node, LINK_VERSION, info)
        self._peers: dict[bytes, PeerInfo] = {}
        self._beats = 0
        self.bad_frames = 0
        self._closed = False
        self._ctx = zmq.Context()
        # The ZAP handler binds before the ROUTER does: libzmq admits every CURVE client
        # while no handler is bound, so the reverse order would leave a window open.
        try:
            self._guard = _Guard(zmq, self._ctx, public)
        except BaseException:
            self._ctx.term()
            raise
        try:
            self._sock = self._ctx.socket(zmq.ROUTER)
            _tune(self._sock, zmq, sndhwm, max_record_bytes)
            # A send to a client that left raises (PeerGone) instead of vanishing.
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.curve_server = True
            self._sock.curve_secretkey = secret
            self._sock.curve_publickey = public
            self._sock.zap_domain = _ZAP_DOMAIN.encode()
            self._guard.start(self._sock.get_monitor_socket())
            bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
            self._sock.bind(f"tcp://{bracketed}:{port or '*'}")
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
        _wait_any(self._zmq, [self._sock], fds, timeout)

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
        peer, body = frames[0], frames[1:]
        try:
            msg = _decode_body(body)
        except BadFrame as e:
            self.bad_frames += 1
            logger.warning("link %s: dropped a message from peer %s: %s", self.node, peer.hex(), e)
            return None
        now = time.monotonic()
        if isinstance(msg, Hello):
            try:
                _check_version(msg, "client")
            except PeerRefused as e:
                logger.warning("link %s: refused peer %s: %s", self.node, peer.hex(), e)
                self._peers.pop(peer, None)
            else:
                self._peers[peer] = PeerInfo(peer, msg, now)
            # Answered even on a version mismatch: the client then refuses us clearly
            # instead of timing out.
            self._send_frames([peer, *_encode_link(self._hello)], 1.0, quiet=True)
            return None
        known = self._peers.get(peer)
        if known is None:
            self.bad_frames += 1
            logger.warning(
                "link %s: dropped a %s from peer %s, which has not said Hello",
                self.node, type(msg).__name__, peer.hex(),
            )  # fmt: skip
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
        self._send_frames([peer, *_encode_link(msg)], timeout)

    def _send_frames(self, frames: list[bytes], timeout: float, quiet: bool = False) -> None:
        try:
            _send(self._sock, self._zmq, frames, timeout)
        except LinkError as e:
            if not quiet:
                raise
            logger.warning("link %s: could not answer peer %s: %s", self.node, frames[0].hex(), e)

    def send_beat(self, timeout: float = 0.1) -> list[bytes]:
        """A Beat to every greeted peer; returns the peers it could not reach."""
        self._beats += 1
        beat = _encode_link(Beat(self.node, self._beats))
        failed = []
        for peer in list(self._peers):
            try:
                _send(self._sock, self._zmq, [peer, *beat], timeout)
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

    def __enter__(self) -> LinkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Guard:
    """The server's thread: answers ZAP requests and logs handshake failures."""

    _monitor: zmq.Socket[Any] | None

    def __init__(self, zmq: ModuleType, ctx: zmq.Context[Any], public: bytes) -> None:
        self._zmq = zmq
        self._public = zmq.utils.z85.decode(public)
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        self._monitor = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # fd -> peer address, read when the connection was accepted (see the docstring).
        self._addresses: dict[int, str] = {}
        self._failure: str | None = None

    def start(self, monitor: zmq.Socket[Any]) -> None:
        self._monitor = monitor
        self._thread = threading.Thread(target=self._run, name="cluster-link-guard", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop the thread (it closes its sockets); False if it would not stop."""
        self._stop.set()
        if self._thread is None:
            self._close_sockets()
            return True
        self._thread.join(timeout=5.0)
        return not self._thread.is_alive()

    def _close_sockets(self) -> None:
        self._zap.close()
        if self._monitor is not None:
            self._monitor.close()

    def _run(self) -> None:
        zmq = self._zmq
        assert self._monitor is not None
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # The timeout only bounds how long close() waits for this thread.
                for sock, _ in poller.poll(100):
                    if sock is self._zap:
                        self._answer_zap(self._zap.recv_multipart())
                    else:
                        self._on_event(zmq.utils.monitor.recv_monitor_message(sock))
        except Exception:
            logger.exception("cluster link guard thread failed; new peers will stall")
        finally:
            self._close_sockets()

    def _answer_zap(self, frames: list[bytes]) -> None:
        # RFC 27: version, request id, domain, address, routing id, mechanism, credentials.
        if len(frames) < 6:
            logger.warning("malformed ZAP request of %d frames ignored", len(frames))
            self._zap.send_multipart([b"1.0", b"", b"500", b"bad request", b"", b""])
            return
        version, request_id, _domain, address, _rid, mechanism, *creds = frames
        ok = mechanism == b"CURVE" and len(creds) == 1
        ok = ok and hmac.compare_digest(creds[0], self._public)
        if ok:
            status, text = b"200", b"OK"
        else:
            status, text = b"400", b"not the cluster key"
            logger.warning(
                "refused a cluster peer from %s: its %s key is not the cluster key",
                address.decode(errors="replace") or "unknown", mechanism.decode(errors="replace"),
            )  # fmt: skip
        self._zap.send_multipart([version, request_id, status, text, b"", b""])

    def _on_event(self, event: dict[str, Any]) -> None:
        zmq, kind, value = self._zmq, event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self._addresses[value] = _peer_address(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failure = f"protocol error {_event_name(zmq, 'PROTOCOL_ERROR_', value)}"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._failure = "closed during the handshake"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._failure = ""  # the ZAP handler logged it, with the address
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._failure = None
        elif kind == zmq.EVENT_DISCONNECTED:
            # libzmq reports a handshake failure, then at once the disconnect of that
            # same connection by fd: that is how a failure finds its address.
            address = self._addresses.pop(value, "unknown")
            if self._failure:
                logger.warning(
                    "refused a cluster peer from %s: CURVE handshake failed (%s); "
                    "is its --cluster-key the same as ours?", address, self._failure,
                )  # fmt: skip
            self._failure = None


def _peer_address(fd: int) -> str:
    """host:port of the TCP connection on ``fd``, read without taking the fd over."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
    except OSError:
        return "unknown"
    return f"{host}:{port}"


class LinkClient:
    """The connecting side: one DEALER to one server's ``address`` (host:port)."""

    def __init__(
        self,
        address: str,
        cluster_key: str,
        node: str,
        info: bytes = b"",
        *,
        sndhwm: int = 4096,
        max_record_bytes: int = 64 << 20,
    ) -> None:
        self._zmq = zmq = _zmq()
        public, secret = cluster_keypair(cluster_key)
        host, port = _split_address(address)
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self._endpoint = f"tcp://{bracketed}:{port}"
        self.node = node
        self._hello = Hello(node, LINK_VERSION, info)
        self.server: Hello | None = None
        self._last_heard = 0.0
        self._last_beat = 0
        self._beats = 0
        self.bad_frames = 0
        self._closed = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _tune(self._sock, zmq, sndhwm, max_record_bytes)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._sock.curve_serverkey = public
        self._sock.curve_publickey = public
        self._sock.curve_secretkey = secret
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
        _send(self._sock, self._zmq, _encode_link(self._hello), max(0.0, timeout))
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
                _send(self._sock, zmq, _encode_link(self._hello), 0.1)
            return
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"the server refused our key (ZAP status {value})"
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = f"CURVE handshake failed ({_event_name(zmq, 'PROTOCOL_ERROR_', value)})"
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
        try:
            msg = _decode_body(frames)
        except BadFrame as e:
            self.bad_frames += 1
            logger.warning("link %s: dropped a message from the server: %s", self.node, e)
            return None
        self._last_heard = time.monotonic()
        if isinstance(msg, Hello):
            _check_version(msg, "server")
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
        _send(self._sock, self._zmq, [records.encode(msg)], timeout)

    def send_link(self, msg: LinkRecord, timeout: float = 1.0) -> None:
        """Send one of the link's owner records to the server (errors as ``send``)."""
        self._require_hello()
        _send(self._sock, self._zmq, _encode_link(msg), timeout)

    def wait(self, fds: list[int], timeout: float) -> None:
        """As ``LinkServer.wait``."""
        _wait_any(self._zmq, [self._sock, self._monitor], fds, timeout)

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
        self._beats += 1
        _send(self._sock, self._zmq, _encode_link(Beat(self.node, self._beats)), timeout)

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

    def __enter__(self) -> LinkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "LINK_VERSION",
    "Beat",
    "Hello",
    "Join",
    "LinkClient",
    "LinkRecord",
    "LinkServer",
    "PeerInfo",
    "Relay",
    "Rows",
    "Welcome",
    "check_cluster_key",
    "cluster_keypair",
]
