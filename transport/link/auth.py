"""The link's authentication: the CURVE keypair every node derives from the shared
``--cluster-key``, and the server's guard thread (ZAP handler and handshake monitor) that
admits only that key and logs every refusal with the peer's address."""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import socket
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

from transport.errors import ClusterUnavailable

if TYPE_CHECKING:
    import zmq

# One logger for the whole link (auth, server, client): what operators filter refusals by.
logger = logging.getLogger("transport.link")

MIN_KEY_CHARS = 16
# scrypt's cost, fixed for ever: every node must derive the same key. About 50 ms once
# per link object, and 16 MiB; a guess costs an attacker the same.
_KDF_SALT = b"pdserve cluster link / CURVE v1"
_KDF_N, _KDF_R, _KDF_P = 2**14, 8, 1
ZAP_DOMAIN = "pdserve.cluster"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ's ZAP specification


def zmq_module() -> ModuleType:
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
    zmq = zmq_module()
    raw = hashlib.scrypt(key.encode(), salt=_KDF_SALT, n=_KDF_N, r=_KDF_R, p=_KDF_P, dklen=32)
    secret = zmq.utils.z85.encode(raw)
    return zmq.curve_public(secret), secret


def event_name(zmq: ModuleType, prefix: str, value: int) -> str:
    """A monitor event's value by its zmq constant's name (``PROTOCOL_ERROR_``...)."""
    names = [n for n in dir(zmq) if n.startswith(prefix) and getattr(zmq, n) == value]
    return names[0].removeprefix(prefix).lower() if names else str(value)


class Guard:
    """The server's thread: answers ZAP requests and logs handshake failures.

    Built (its ZAP socket bound) before the server's ROUTER binds: libzmq admits every
    CURVE client while no handler is bound.
    """

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
            peer = address.decode(errors="replace") or "unknown"
            kind = mechanism.decode(errors="replace")
            logger.warning(
                "refused a cluster peer from %s: its %s key is not the cluster key", peer, kind
            )
        self._zap.send_multipart([version, request_id, status, text, b"", b""])

    def _on_event(self, event: dict[str, Any]) -> None:
        zmq, kind, value = self._zmq, event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self._addresses[value] = _peer_address(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failure = f"protocol error {event_name(zmq, 'PROTOCOL_ERROR_', value)}"
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
                    "is its --cluster-key the same as ours?",
                    address,
                    self._failure,
                )
            self._failure = None


def _peer_address(fd: int) -> str:
    """host:port of the TCP connection on ``fd``, read without taking the fd over."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
    except OSError:
        return "unknown"
    return f"{host}:{port}"
