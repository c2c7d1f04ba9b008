"""The frontends' board: what several frontend processes share (one buffer plays the
shared memory; each ``FrontendBoard`` view is one frontend)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from frontend.engine_link.board import FrontendBoard
from frontend.engine_link.engine_client import (
    EngineClient,
    EngineRequest,
    WorkerHealth,
    WorkerReport,
)
from frontend.telemetry.metrics import FrontendMetrics
from router.ledger import Cell, InFlight
from router.router import NoCapacity, Router, RouterConfig
from tests.router.sim import start_cluster
from transport.load_table import LoadTable, WorkerState
from wire.records import TextDelta


def _boards(n: int = 2, shards: int = 2, workers: int = 4) -> tuple[bytearray, list[FrontendBoard]]:
    buf = bytearray(FrontendBoard.layout_nbytes(n, shards, workers))
    FrontendBoard.format(buf, n, shards, workers)
    boards = [FrontendBoard(buf, me=i) for i in range(n)]
    for b in boards:
        b.claim()
        b.set_state(WorkerState.READY)
    return buf, boards


def test_each_frontend_sees_the_others_in_flight_for_the_same_generation_only() -> None:
    _, (a, b) = _boards()
    a.publish(
        2,
        Cell(
            generation=3,
            sent_requests=5,
            sent_tokens=500,
            reserved_requests=2,
            reserved_tokens=300,
            assigned_requests=5,
            assigned_tokens=500,
        ),
    )
    assert b.others(2, 3) == InFlight(5, 500, 2, 300)
    assert a.others(2, 3) == InFlight()  # not its own
    assert b.others(2, 4) == InFlight()  # a restarted worker: those were for the old one
    assert b.assigned(2) == (5, 500) and b.assigned(1) == (0, 0)


def test_a_dead_frontend_keeps_what_it_sent_but_not_its_reservations() -> None:
    buf, (a, b) = _boards()
    a.publish(0, Cell(1, 4, 40, 3, 90, 4, 40))
    FrontendBoard(buf).mark_dead(0)  # the launcher's view
    assert b.others(0, 1) == InFlight(4, 40, 0, 0)
    assert [(f.index, f.state) for f in b.frontends()] == [
        (0, WorkerState.DEAD),
        (1, WorkerState.READY),
    ]
    again = FrontendBoard(buf, me=0)  # its restart goes on from its predecessor's books
    assert again.claim() == 2
    assert again.own(0) == Cell(1, 4, 40, 0, 0, 4, 40)


def test_health_figures_are_summed_over_live_frontends() -> None:
    buf, (a, b) = _boards(shards=2)
    a.set_active([3, 1])
    b.set_active([0, 2])
    assert a.active_per_shard() == b.active_per_shard() == [3, 3]
    FrontendBoard(buf).mark_dead(1)
    assert a.active_per_shard() == [3, 1]
    assert not FrontendBoard(buf).all_ready()


def test_two_routers_sharing_the_board_hold_the_bound_together() -> None:
    """Nothing reported by the workers yet: only the routers' books stand between a burst
    and the bound, and two routers must not each admit a bound's worth."""
    table_buf = bytearray(LoadTable.layout_nbytes(4))
    cluster = start_cluster(table_buf, 2, 2)
    _, boards = _boards(workers=4)
    config = RouterConfig(max_waiting_requests=4)
    routers = [Router(cluster.table, config=config, peers=b) for b in boards]
    alone = Router(cluster.table, config=config)
    single = 0
    while True:
        try:
            alone.place(32, 4)
        except NoCapacity:
            break
        single += 1
    placed = 0
    for turn in range(4 * single):
        try:
            routers[turn % 2].place(32, 4)
            placed += 1
        except NoCapacity:
            continue
    assert placed == single == 8
    for r in routers:
        with pytest.raises(NoCapacity):
            r.check_capacity()


class _Idle(EngineClient):
    """An engine client with nothing behind it: only its board and index matter here."""

    def __init__(self, board: FrontendBoard) -> None:
        self.board, self.owner = board, board.me or 0

    async def generate(self, req: EngineRequest) -> AsyncIterator[TextDelta]:
        raise NotImplementedError
        yield

    def check_admission(self) -> None:
        pass

    async def abort(self, rid: int) -> None:
        pass

    def health(self) -> list[WorkerHealth]:
        return []

    def metrics_snapshot(self) -> list[WorkerReport]:
        return []


def test_metrics_from_either_frontend_are_the_servers_sum() -> None:
    _, boards = _boards()
    a, b = (FrontendMetrics(_Idle(board), nvml=False) for board in boards)
    a.prompt_tokens.inc(3)
    b.prompt_tokens.inc(4)
    a.ttft.observe(0.003)
    b.ttft.observe(30.0)
    b.requests.labels(finish_reason="stop").inc()
    b.add_acceptor(lambda: (5, 2, 0))
    for m in (a, b):
        text = m.render()[0].decode()
        assert "pdserve_prompt_tokens_total 7.0" in text
        assert 'pdserve_time_to_first_token_seconds_bucket{le="0.005"} 1.0' in text
        assert 'pdserve_time_to_first_token_seconds_bucket{le="+Inf"} 2.0' in text
        assert "pdserve_time_to_first_token_seconds_count 2.0" in text
        assert 'pdserve_requests_total{finish_reason="stop"} 1.0' in text
        assert 'pdserve_frontend_requests_total{frontend="1"} 1.0' in text
        assert 'pdserve_frontend_requests_total{frontend="0"} 0.0' in text
    assert "pdserve_http_connections_accepted_total 5.0" in a.render()[0].decode()
