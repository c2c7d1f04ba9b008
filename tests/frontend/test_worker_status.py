"""``/health`` counts the workers the launch started, not only those that have shown up."""

from __future__ import annotations

import mmap
import os

from frontend.engine_link.worker_status import worker_health
from transport.load_table import LoadTable, WorkerState
from wire.roles import Role

_EXPECTED = [(Role.PREFILL, 0), (Role.PREFILL, 1), (Role.DECODE, 0)]


def _states(table: LoadTable) -> dict[tuple[str, int], tuple[str, bool]]:
    report = worker_health(table, _EXPECTED, [], {}, stall_report_s=5.0)
    return {(w.role, w.index): (w.state, w.alive) for w in report}


def test_workers_that_have_not_claimed_a_row_are_starting_not_absent() -> None:
    table = LoadTable(mmap.mmap(-1, LoadTable.layout_nbytes(4)), 4)
    assert _states(table) == {("prefill", 0): ("starting", False),
                              ("prefill", 1): ("starting", False),
                              ("decode", 0): ("starting", False)}  # fmt: skip
    w = table.writer(2)
    w.claim(Role.PREFILL, 1, pid=os.getpid())
    w.set_state(WorkerState.READY)
    states = _states(table)
    assert states[("prefill", 1)] == ("ready", True)
    # The decode worker has not shown up yet: its role is not served.
    assert states[("decode", 0)] == ("starting", False) and states[("prefill", 0)][1] is False
    report = worker_health(table, _EXPECTED, [], {}, stall_report_s=5.0)
    assert [(w.role, w.index) for w in report] == [("prefill", 0), ("prefill", 1), ("decode", 0)]
    assert {tuple(w.load) for w in report} == {tuple(report[1].load)}  # same keys for all
