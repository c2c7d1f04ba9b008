"""Ring names: the only place a ring's name is formatted or parsed.

A ring is named for what it carries and its two ends, ``kind.src.dst``; an end is a role's
letter (``Role.letter``) and an index (``f0``, ``p0``, ``d1``, ``k0``, ``c2``). The launcher creates rings
under these names and every process finds its rings by them.

Rings (n = frontend, i = prefill, j = decode, c = co-located worker, k = detokenizer shard):
    req.f{n}.p{i}   frontend n -> prefill i   GenerateRequest, AbortRequest
    ctl.f{n}.d{j}   frontend n -> decode j    AbortRequest
    ctl.f{n}.k{k}   frontend n -> detok k     DetokRegister, AbortRequest
    kv.p{i}.d{j}    prefill i -> decode j     KVTransfer, KVPoolHandle
    rel.d{j}.p{i}   decode j -> prefill i     KVRelease
    tok.p{i}.k{k}   prefill i -> detok k      TokenBatch (first tokens)
    tok.d{j}.k{k}   decode j -> detok k       TokenBatch
    stop.k{k}.d{j}  detok k -> decode j       AbortRequest (a stop string matched)
    text.k{k}.f{n}  detok k -> frontend n     TextBatch (of the requests frontend n owns)
With ``--colocated N`` there are no prefill/decode rings; instead:
    req.f{n}.c{c}   frontend n -> colocated c GenerateRequest, AbortRequest
    tok.c{c}.k{k}   colocated c -> detok k    TokenBatch (first and later tokens)
    stop.k{k}.c{c}  detok k -> colocated c    AbortRequest (a stop string matched)
With ``--workers N`` (co-located workers whose roles change) also, for c != w:
    kv.c{c}.c{w}    worker c -> worker w      KVTransfer (c prefilled, w decodes)
    rel.c{w}.c{c}   worker w -> worker c      KVRelease
Every frontend (``launch --api-workers N``) has its own rings to every worker and shard:
rings stay single-producer, single-consumer. Which frontend owns a request is in its id
(``wire/rids.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from wire.roles import Role


class RingKind(enum.StrEnum):
    REQ = "req"
    CTL = "ctl"
    KV = "kv"
    REL = "rel"
    TOK = "tok"
    STOP = "stop"
    TEXT = "text"


@dataclass(frozen=True, order=True, slots=True)
class Peer:
    """One end of a ring: a role and its index, written ``p0``, ``f1``, ..."""

    role: Role
    index: int = 0

    def __str__(self) -> str:
        return f"{self.role.letter}{self.index}"

    @classmethod
    def parse(cls, text: str) -> Peer:
        role = Role.from_letter(text[0])
        if not text[1:].isdigit():
            raise ValueError(f"bad ring end {text!r}")
        return cls(role, int(text[1:]))


class RingName(NamedTuple):
    kind: RingKind
    src: Peer
    dst: Peer

    def __str__(self) -> str:
        return f"{self.kind}.{self.src}.{self.dst}"

    @classmethod
    def parse(cls, text: str) -> RingName:
        parts = text.split(".")
        if len(parts) != 3:
            raise ValueError(f"bad ring name {text!r}: expected kind.src.dst")
        kind, src, dst = parts
        return cls(RingKind(kind), Peer.parse(src), Peer.parse(dst))
