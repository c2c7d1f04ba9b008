"""Placement among ``launch --workers`` workers by their roles, and per-request placement."""

from __future__ import annotations

import pytest

from router.roles import LOCAL_PROMPT_TOKENS, LOCAL_QUEUE_MARGIN, local_is_sooner
from router.router import NoCapacity, Router
from transport.load_table import LoadTable, WorkerState
from transport.role_table import RoleTable
from wire.roles import Role

C, P, D = Role.COLOCATED, Role.PREFILL, Role.DECODE


def _server(n: int, queued: list[int] | None = None) -> tuple[LoadTable, RoleTable, Router]:
    table = LoadTable(bytearray(LoadTable.layout_nbytes(n)), n)
    for i in range(n):
        w = table.writer(i)
        w.claim(Role.COLOCATED, i, block_size=16)
        w.set_state(WorkerState.READY)
        w.publish(
            free_kv_blocks=1000,
            total_kv_blocks=1000,
            queued_prefill_tokens=0 if queued is None else queued[i],
        )
    roles = RoleTable.format(bytearray(RoleTable.layout_nbytes(n, 1)), n, 1)
    return table, roles, Router(table, roles=roles, config=None)


def test_colocated_workers_take_requests_whole() -> None:
    _, roles, router = _server(2)
    for _ in range(4):
        p = router.place(200, 16)
        assert p.colocated and p.prefill == p.decode
    assert roles.placements() == {"handoff": 0, "local": 0, "colocated": 4}


def test_with_one_colocated_worker_it_takes_everything_until_it_dies() -> None:
    table, roles, router = _server(3)
    roles.set(1, D)
    roles.set(2, D)
    for _ in range(4):
        p = router.place(200, 16)
        assert (p.prefill, p.decode) == (0, 0) and p.colocated
    table.writer(0).set_state(WorkerState.DEAD)
    seen = {router.place(200, 16).prefill for _ in range(4)}
    assert seen <= {1, 2} and seen  # the idle decoders take requests whole meanwhile
    assert roles.placements() == {"handoff": 0, "local": 4, "colocated": 4}


def test_prefill_workers_hand_long_prompts_to_decode_workers() -> None:
    _, roles, router = _server(3)
    roles.set(0, P)
    roles.set(1, P)
    roles.set(2, D)
    seen = set()
    for _ in range(6):
        p = router.place(200, 16)
        assert p.prefill in (0, 1) and p.decode == 2
        seen.add(p.prefill)
    assert seen == {0, 1}  # balanced over the prefill workers
    assert roles.placements()["handoff"] == 6


def test_a_short_prompt_is_prefilled_where_it_decodes() -> None:
    _, roles, router = _server(2)
    roles.set(0, P)
    roles.set(1, D)
    p = router.place(LOCAL_PROMPT_TOKENS, 16)
    assert (p.prefill, p.decode) == (1, 1)
    p = router.place(LOCAL_PROMPT_TOKENS + 1, 16)
    assert (p.prefill, p.decode) == (0, 1)
    assert roles.placements() == {"handoff": 1, "local": 1, "colocated": 0}


def test_a_long_prefill_queue_sends_the_request_to_its_decoder_whole() -> None:
    _, roles, router = _server(2, queued=[3 * LOCAL_QUEUE_MARGIN, 0])
    roles.set(0, P)
    roles.set(1, D)
    p = router.place(200, 16)
    assert (p.prefill, p.decode) == (1, 1)
    assert local_is_sooner(200, 200 + LOCAL_QUEUE_MARGIN + 1, 0, 0)
    assert not local_is_sooner(200, 200 + LOCAL_QUEUE_MARGIN, 0, 0)
    # Not beside running requests (it would stall their decode steps); a short one may.
    assert not local_is_sooner(200, 200 + LOCAL_QUEUE_MARGIN + 1, 0, 1)
    assert local_is_sooner(LOCAL_PROMPT_TOKENS, 0, 0, 8)


def test_decode_workers_take_no_new_prefill_and_a_dead_decoder_falls_back() -> None:
    table, roles, router = _server(2)
    roles.set(0, P)
    roles.set(1, D)
    table.writer(1).set_state(WorkerState.DEAD)
    p = router.place(200, 16)
    assert (p.prefill, p.decode) == (0, 0)  # its prefill worker decodes it too
    table.writer(0).set_state(WorkerState.DEAD)
    with pytest.raises(NoCapacity):
        router.place(200, 16)
    with pytest.raises(NoCapacity):
        router.check_capacity()
