"""``/health`` counts the workers the launch started, not only those that have shown up,
and names the node each of them runs on."""

from __future__ import annotations

import mmap
import os
import time

import msgspec

from frontend.engine_link.board import FrontendBoard
from frontend.engine_link.engine_client import WorkerHealth
from frontend.engine_link.worker_status import frontend_health, worker_health, worker_metrics
from frontend.http.health import health_report
from transport.load_table import LoadTable, WorkerState
from transport.ring import Ring
from wire.roles import Role

_EXPECTED = [(Role.PREFILL, 0), (Role.PREFILL, 1), (Role.DECODE, 0)]


def _states(table: LoadTable) -> dict[tuple[str, int], tuple[str, bool]]:
    report = worker_health(table, _EXPECTED, [], {}, stall_report_s=5.0, node="a")
    return {(w.role, w.index): (w.state, w.alive) for w in report}


def test_workers_that_have_not_claimed_a_row_are_starting_not_absent() -> None:
    table = LoadTable(mmap.mmap(-1, LoadTable.layout_nbytes(4)), 4)
    assert _states(table) == {
        ("prefill", 0): ("starting", False),
        ("prefill", 1): ("starting", False),
        ("decode", 0): ("starting", False),
    }
    w = table.writer(2)
    w.claim(Role.PREFILL, 1, pid=os.getpid())
    w.set_state(WorkerState.READY)
    states = _states(table)
    assert states[("prefill", 1)] == ("ready", True)
    # The decode worker has not shown up yet: its role is not served.
    assert states[("decode", 0)] == ("starting", False) and states[("prefill", 0)][1] is False
    report = worker_health(table, _EXPECTED, [], {}, stall_report_s=5.0, node="a")
    assert [(w.role, w.index) for w in report] == [("prefill", 0), ("prefill", 1), ("decode", 0)]
    assert {tuple(w.load) for w in report} == {tuple(report[1].load)}  # same keys for all


def _cluster_table() -> LoadTable:
    """A head's view: prefill 0 (node a), local decode 0 (a writer that named no node),
    decode 1 mirrored from node b0, decode 2 of the reserve not brought yet."""
    table = LoadTable(bytearray(LoadTable.layout_nbytes(4)), 4)
    for slot, role, index, node in ((0, Role.PREFILL, 0, "a"), (1, Role.DECODE, 0, "")):
        w = table.writer(slot)
        w.claim(role, index, pid=os.getpid(), node=node)
        w.publish(running_requests=slot + 1, total_kv_blocks=10, free_kv_blocks=5)
        w.set_state(WorkerState.READY)
    member = LoadTable(bytearray(LoadTable.layout_nbytes(4)), 4)  # node b0's own table
    member.writer(2).claim(Role.DECODE, 1, pid=1, node="b0-as-it-calls-itself")
    member.writer(2).set_state(WorkerState.READY)
    table.writer(2).mirror(member.snapshot()[2], time.monotonic_ns(), "b0")
    return table


_RESERVE = {(Role.DECODE, 2)}


def test_each_worker_names_its_node_and_shards_run_on_the_frontends() -> None:
    table = _cluster_table()
    expected = [(Role.PREFILL, 0), (Role.DECODE, 0), (Role.DECODE, 1), (Role.DECODE, 2)]
    owner = Ring.create(f"wst{time.monotonic_ns()}", 1 << 10)
    shard = Ring.attach(owner.spec, "consumer")  # the frontend's end of a text ring
    report = worker_health(
        table, expected, [shard], {}, stall_report_s=5.0, node="a", remote=_RESERVE
    )
    nodes = {(w.role, w.index): (w.node, w.state) for w in report}
    assert nodes == {
        ("prefill", 0): ("a", "ready"),
        ("decode", 0): ("a", "ready"),  # its row names no node: the frontend's
        ("decode", 1): ("b0", "ready"),  # as the head's gateway mirrored it
        ("decode", 2): ("", "starting"),  # no node has brought it yet
        ("detokenizer", 0): ("a", nodes[("detokenizer", 0)][1]),
    }
    board = FrontendBoard.private()
    board.claim()
    assert [(f.role, f.index, f.node) for f in frontend_health(board, node="a")] == [
        ("frontend", 0, "a")
    ]


def test_metrics_carry_each_workers_node() -> None:
    table = _cluster_table()
    got = worker_metrics(table, {(Role.DECODE, 1): (3, 30)}, node="a", remote=_RESERVE)
    assert {(m.role, m.index, m.node) for m in got} == {
        ("prefill", 0, "a"),
        ("decode", 0, "a"),
        ("decode", 1, "b0"),
    }
    (d1,) = [m for m in got if (m.role, m.index) == ("decode", 1)]
    assert (d1.assigned_requests, d1.assigned_tokens) == (3, 30)


class _Health:
    def __init__(self, workers: list[WorkerHealth]) -> None:
        self.workers = workers

    def health(self) -> list[WorkerHealth]:
        return self.workers


def test_health_sums_up_each_node_and_keeps_its_status_rules() -> None:
    def worker(role: str, index: int, alive: bool, node: str) -> WorkerHealth:
        return WorkerHealth(role, index, 1, alive, {}, "ready" if alive else "dead", node=node)

    workers = [
        worker("prefill", 0, True, "a"),
        worker("decode", 0, True, "b0"),
        worker("decode", 1, False, "b1"),
        worker("detokenizer", 0, True, "a"),
    ]
    status, body = health_report(_Health(workers))  # type: ignore[arg-type]
    doc = msgspec.json.decode(body)
    assert (status, doc["status"]) == (200, "degraded")  # one decode worker is still alive
    assert doc["nodes"] == {
        "a": {"workers": 2, "alive": 2},
        "b0": {"workers": 1, "alive": 1},
        "b1": {"workers": 1, "alive": 0},
    }
    assert [w["node"] for w in doc["workers"]] == ["a", "b0", "b1", "a"]
    workers[1] = worker("decode", 0, False, "b0")
    status, body = health_report(_Health(workers))  # type: ignore[arg-type]
    doc = msgspec.json.decode(body)
    assert (status, doc["status"]) == (503, "unavailable")
    assert doc["nodes"]["b0"] == {"workers": 1, "alive": 0}
