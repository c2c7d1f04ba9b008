"""Request ids name their owning frontend; ring ends name the frontend by index."""

from __future__ import annotations

import itertools

import pytest

from wire.rids import MAX_FRONTENDS, owned_rids, owner_of
from wire.ring_names import Peer, RingKind, RingName
from wire.roles import Role


@pytest.mark.parametrize("owner", [0, 1, 7, MAX_FRONTENDS - 1])
def test_every_rid_names_its_owner_and_fits_an_int64(owner: int) -> None:
    rids = list(itertools.islice(owned_rids(owner), 100))
    assert len(set(rids)) == 100
    assert all(owner_of(r) == owner and 0 <= r < 2**63 for r in rids)


def test_a_restarted_frontend_starts_elsewhere_and_bad_owners_are_refused() -> None:
    assert next(owned_rids(1)) != next(owned_rids(1))  # random starts (2**40 of them)
    assert next(owned_rids(3, start=5)) == (3 << 56) | 5
    with pytest.raises(ValueError):
        owned_rids(MAX_FRONTENDS)


def test_frontend_ring_ends_carry_their_index() -> None:
    name = RingName(RingKind.TEXT, Peer(Role.DETOK, 0), Peer(Role.FRONTEND, 1))
    assert str(name) == "text.k0.f1" and RingName.parse("text.k0.f1") == name
    with pytest.raises(ValueError):
        Peer.parse("f")
