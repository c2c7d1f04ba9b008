"""Typed errors raised at the transport boundary."""

from __future__ import annotations


class TransportError(RuntimeError):
    """Base class of every error the transport raises."""


class ShmTooSmall(TransportError):
    """/dev/shm cannot hold a segment: a deployment error, caught at startup."""

    def __init__(self, tag: str, needed: int, free: int) -> None:
        super().__init__(
            f"/dev/shm has {free / 2**20:.1f} MiB free but segment {tag!r} needs "
            f"{needed / 2**20:.1f} MiB. Give the container more shared memory "
            "(docker run --shm-size=<size>, e.g. --shm-size=8g, or --ipc=host)."
        )
        self.needed = needed
        self.free = free


class RingFull(TransportError):
    """put() timed out: the consumer did not free space in time. Nothing was written."""


class RecordTooLarge(TransportError):
    """A record can never fit the ring, whatever the consumer does."""


class PeerDead(TransportError):
    """The process on the other side of a ring has exited."""


class KVTransferError(TransportError):
    """A KV block copy cannot be done as asked (bad block ids, unknown source, layout)."""


class KVReadFailed(KVTransferError):
    """A copy across the network failed or passed its deadline: the source host may be
    gone or cut off. Unlike a refused copy, prefilling the request again elsewhere can
    succeed."""


class ClusterUnavailable(TransportError):
    """Several hosts need the ``nixl`` extra (pyzmq with CURVE for the link, NIXL for KV),
    and this install lacks part of it."""


class LinkError(TransportError):
    """Base class of the errors of a cross-host link (``transport.link``)."""


class PeerRefused(LinkError):
    """The other node refused us, or we refused it: wrong cluster key or link version."""


class LinkTimeout(LinkError):
    """A bounded link operation (connect, send) did not finish within its timeout."""


class PeerGone(LinkError):
    """A record was addressed to a peer that is not connected (never was, or left)."""


class BadFrame(LinkError):
    """A message on the link does not decode; only that message is dropped."""
