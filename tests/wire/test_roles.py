"""Role: one enum, its ring letters and load-table codes fixed, worker names derived."""

from __future__ import annotations

import pytest

from wire.ring_names import Peer
from wire.roles import ENGINE_ROLES, Role


def test_load_table_codes_are_the_stored_bytes() -> None:
    # NOTE: these bytes are in shared memory that every process reads: never renumber.
    assert {r: r.table_code for r in ENGINE_ROLES} == {
        Role.PREFILL: 1,
        Role.DECODE: 2,
        Role.COLOCATED: 3,
    }
    assert Role.from_table_code(0) is None  # an unclaimed slot
    assert all(Role.from_table_code(r.table_code) is r for r in ENGINE_ROLES)
    with pytest.raises(ValueError, match="code 9"):
        Role.from_table_code(9)


def test_ring_letters_round_trip() -> None:
    # Frontend, prefill, decode, detok, colocated, gateway: the letters in ring names.
    assert {r: r.letter for r in Role} == dict(zip(Role, "fpdkcg", strict=True))
    assert all(Peer.parse(str(Peer(r, 3))) == Peer(r, 3) for r in Role)
    with pytest.raises(ValueError):
        Peer.parse("x0")


def test_names_are_derived_here() -> None:
    assert Role.PREFILL.worker_name(0) == "prefill-0"
    assert Role.DETOK.worker_name(2) == "detok-2"
    assert Role.DETOK.health_label == "detokenizer"
    assert Role("colocated") is Role.COLOCATED
    assert not Role.FRONTEND.is_engine and Role.DECODE.is_engine
