"""A worker's counters are one record (transport/worker_load.py): what the worker
publishes is what the load table's row and the frontend's report carry, field for field."""

from __future__ import annotations

import dataclasses

import pytest

from frontend.engine_link.worker_status import worker_metrics
from transport.load_table import LoadRow, LoadTable
from transport.worker_load import LOAD_FIELDS, SPECULATION_FIELDS, WorkerLoad
from wire.roles import Role


def test_a_published_load_reads_back_whole_in_the_row_and_the_report() -> None:
    table = LoadTable(bytearray(LoadTable.layout_nbytes(1)), 1)
    w = table.writer(0)
    w.claim(Role.DECODE, 3, block_size=16, node="n")
    sent = WorkerLoad(**{name: 1000 + i for i, name in enumerate(LOAD_FIELDS)})
    w.publish(sent)
    (row,) = table.snapshot()
    assert isinstance(row, LoadRow) and isinstance(row, WorkerLoad)
    assert {n: getattr(row, n) for n in LOAD_FIELDS} == dataclasses.asdict(sent)
    (report,) = worker_metrics(table, {(Role.DECODE, 3): (2, 20)}, node="n")
    assert {n: getattr(report.load, n) for n in LOAD_FIELDS} == dataclasses.asdict(sent)
    assert report.speculation == tuple(getattr(sent, n) for n in SPECULATION_FIELDS)


def test_a_partial_publish_keeps_the_other_fields_and_refuses_unknown_names() -> None:
    table = LoadTable(bytearray(LoadTable.layout_nbytes(1)), 1)
    w = table.writer(0)
    w.claim(Role.PREFILL, 0, block_size=16)
    w.publish(WorkerLoad(waiting_requests=4, total_kv_blocks=10, free_kv_blocks=5))
    w.publish(running_requests=2)
    (row,) = table.snapshot()
    assert (row.waiting_requests, row.running_requests, row.kv_usage) == (4, 2, 0.5)
    with pytest.raises(TypeError, match="running"):
        w.publish(running=1)


def test_the_old_restatements_are_gone() -> None:
    import frontend.engine_link.engine_client as client
    import runtime.worker as worker

    assert not hasattr(worker, "QueueLoad")
    assert not hasattr(client, "WorkerMetrics")
