"""The cluster link's own records: what nodes on different hosts say to each other besides
the ring records they relay (``wire.records``).

A link record travels as two frames, ``[LINK_TAG, msgpack]`` (``encode_link``), so it needs
no kind byte in ``wire.records``' space. ``Hello`` and ``Beat`` are handled by the link
itself (``transport.link``); ``Relay``, ``Rows``, ``Join`` and ``Welcome`` are the node
gateway's (``cluster.gateway``) and reach it through the link untouched.
"""

from __future__ import annotations

import msgspec

LINK_VERSION = 2  # 2: token batch rows carry speculation counts (wire/records.py)
LINK_TAG = b"pdserve.link"  # first frame of the link's own records


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

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Hello | Beat | Relay | Rows | Join | Welcome)


def encode_link(msg: Hello | Beat | LinkRecord) -> list[bytes]:
    """The frames of one link record."""
    return [LINK_TAG, _encoder.encode(msg)]


def decode_link(body: bytes) -> Hello | Beat | LinkRecord:
    """The record in a link record's second frame; ``msgspec.DecodeError`` if it is none."""
    return _decoder.decode(body)
