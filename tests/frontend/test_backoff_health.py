"""``/health`` says when a worker in crash-loop back-off is retried, and a new request
waits only for workers that are being restarted, not for ones in back-off."""

from __future__ import annotations

import os
import time

from frontend.engine_link.board import FrontendBoard
from frontend.engine_link.worker_status import restart_pending, worker_health
from transport.load_table import LoadTable, WorkerState
from wire.roles import Role


class _Shard:
    """A text ring whose shard is alive or not."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.peer_pid = os.getpid() if alive else 0

    def peer_alive(self) -> bool:
        return self.alive


def _table() -> LoadTable:
    table = LoadTable(bytearray(LoadTable.layout_nbytes(2)), 2)
    for slot, index in ((0, 0), (1, 1)):
        w = table.writer(slot)
        w.claim(Role.DECODE, index, pid=os.getpid())
        w.set_state(WorkerState.READY)
    return table


def test_health_shows_when_a_failed_worker_and_a_failed_shard_come_back() -> None:
    table, board = _table(), FrontendBoard.private(num_shards=2, num_workers=2)
    table.writer(1).mark_exited(WorkerState.FAILED, -9, Role.DECODE, 1)
    soon = time.time() + 30
    board.set_retry_at(1, soon)  # slot 1: decode 1
    board.set_retry_at(2 + 1, soon + 1)  # shard 1
    rings = [_Shard(True), _Shard(False)]
    report = worker_health(
        table,
        [(Role.DECODE, 0), (Role.DECODE, 1)],
        rings,
        {},
        5.0,
        node="a",
        board=board,  # type: ignore[arg-type]
    )
    by = {(w.role, w.index): w for w in report}
    assert by[("decode", 1)].state == "failed" and by[("decode", 1)].retry_at == soon
    assert by[("decode", 0)].retry_at is None
    assert by[("detokenizer", 1)].state == "failed" and by[("detokenizer", 1)].retry_at == soon + 1
    assert by[("detokenizer", 0)].state == "ready" and by[("detokenizer", 0)].retry_at is None


def test_only_a_worker_being_restarted_is_waited_for() -> None:
    table, board = _table(), FrontendBoard.private(num_shards=2, num_workers=2)
    live = [_Shard(True), _Shard(True)]
    assert not restart_pending(table, live, board)  # type: ignore[arg-type]
    table.writer(1).mark_exited(WorkerState.FAILED, -9, Role.DECODE, 1)
    assert not restart_pending(table, live, board)  # type: ignore[arg-type]  # in back-off
    table.writer(0).mark_exited(WorkerState.DEAD, -9, Role.DECODE, 0)
    assert restart_pending(table, live, board)  # type: ignore[arg-type]
    table = _table()
    down = [_Shard(True), _Shard(False)]
    assert restart_pending(table, down, board)  # type: ignore[arg-type]  # shard 1 restarts
    board.set_retry_at(2 + 1, time.time() + 30)
    assert not restart_pending(table, down, board)  # type: ignore[arg-type]  # in back-off
