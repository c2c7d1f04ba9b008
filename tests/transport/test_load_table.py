"""The shared-memory load table: layout, claims, generations, and untorn reads across processes."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from transport import load_table as lt
from transport.load_table import LoadTable, LoadTableError, RowWriter, WorkerState
from wire.roles import Role


def _table(n: int) -> tuple[mmap.mmap, LoadTable]:
    buf = mmap.mmap(-1, LoadTable.layout_nbytes(n))
    return buf, LoadTable(buf, n)


def test_numpy_row_layout_matches_the_packed_payload() -> None:
    assert lt.ROW_DTYPE.itemsize == lt.ROW_NBYTES
    assert 8 + lt._PAYLOAD.size <= lt.ROW_NBYTES
    raw = bytearray(lt.ROW_NBYTES)
    values = list(range(1, len(lt._PAYLOAD_FIELDS) + 1))
    lt._PAYLOAD.pack_into(raw, 8, *values)
    row = np.frombuffer(raw, lt.ROW_DTYPE)[0]
    assert [int(row[f]) for f in lt._PAYLOAD_FIELDS] == values
    # The node name follows the integers; the writer packs both in one call.
    lt._ROW.pack_into(raw, 8, *values, "nœud".encode())
    row = np.frombuffer(raw, lt.ROW_DTYPE)[0]
    assert [int(row[f]) for f in lt._PAYLOAD_FIELDS] == values
    assert row["node"] == "nœud".encode() and 8 + lt._ROW.size <= lt.ROW_NBYTES
    assert lt.ROW_NBYTES % 64 == 0 and lt.HEADER_NBYTES % 8 == 0  # lines; aligned seq words


def test_fresh_slots_read_as_empty_and_are_never_ready() -> None:
    _, table = _table(3)
    snap = table.snapshot()
    assert [r.slot for r in snap] == [0, 1, 2]
    assert all(r.state is WorkerState.EMPTY and r.role is None for r in snap)


def test_publish_is_visible_to_a_second_view_of_the_same_buffer() -> None:
    buf, table = _table(2)
    w = table.writer(1)
    w.claim(Role.DECODE, 3, pid=1234, block_size=16)
    w.publish(free_kv_blocks=90, total_kv_blocks=100, running_requests=4)
    w.set_state(WorkerState.READY)
    row = LoadTable(buf, 2).snapshot()[1]
    assert (row.role, row.index, row.pid, row.state) == (Role.DECODE, 3, 1234, WorkerState.READY)
    assert (row.free_kv_blocks, row.total_kv_blocks, row.running_requests) == (90, 100, 4)
    assert row.block_size == 16 and row.heartbeat_ns > 0


def test_publish_keeps_fields_it_was_not_given() -> None:
    _, table = _table(1)
    w = table.writer(0)
    w.claim(Role.PREFILL, 0)
    w.publish(queued_prefill_tokens=500, waiting_requests=3)
    first = table.snapshot()[0]
    w.publish(waiting_requests=2)
    second = table.snapshot()[0]
    assert second.queued_prefill_tokens == 500 and second.waiting_requests == 2
    assert second.heartbeat_ns >= first.heartbeat_ns


def test_reclaiming_a_slot_bumps_its_generation_and_clears_load() -> None:
    buf, table = _table(1)
    w = table.writer(0)
    assert w.claim(Role.PREFILL, 0, pid=10) == 1
    w.publish(queued_prefill_tokens=777, requests_received=9)
    w.set_state(WorkerState.READY)
    # A restarted worker attaches afresh, as a new process would.
    again = LoadTable(buf, 1).writer(0)
    assert again.claim(Role.PREFILL, 0, pid=11) == 2
    row = table.snapshot()[0]
    assert (row.generation, row.pid, row.state) == (2, 11, WorkerState.STARTING)
    assert row.queued_prefill_tokens == 0 and row.requests_received == 0


def _tear(buf: mmap.mmap, slot: int) -> None:
    """Leave ``slot`` mid-write (seq odd): a preempted writer, or one SIGKILLed mid-write."""
    offset = lt.HEADER_NBYTES + slot * lt.ROW_NBYTES  # the row's seq word
    (seq,) = struct.unpack_from("<Q", buf, offset)
    struct.pack_into("<Q", buf, offset, seq + 1)


def test_a_row_torn_past_the_deadline_reads_as_its_last_consistent_copy() -> None:
    # Seen at startup under load: a writer preempted mid-write for > 2 ms made the router
    # report a live worker DEAD, and /health dropped it. Only the launcher, which reaps
    # the process, may say a worker is dead.
    buf, table = _table(2)
    w = table.writer(0)
    w.claim(Role.PREFILL, 0, pid=77)
    w.publish(queued_prefill_tokens=12)
    w.set_state(WorkerState.READY)
    before = table.snapshot()[0]
    _tear(buf, 0)
    t0 = time.monotonic()
    torn = table.snapshot()
    assert time.monotonic() - t0 < 0.5  # the reader gives up waiting, it does not hang
    assert torn[0] == before and torn[0].state is WorkerState.READY
    assert torn[1].state is WorkerState.EMPTY  # the other rows are read as usual
    w.publish(queued_prefill_tokens=13)  # the writer resumes: fresh values again
    assert table.snapshot()[0].queued_prefill_tokens == 13


def test_a_torn_row_never_read_before_is_unknown_not_dead() -> None:
    buf, table = _table(1)
    table.writer(0).claim(Role.DECODE, 2, pid=55)
    _tear(buf, 0)
    row = LoadTable(buf, 1).snapshot()[0]  # a reader with no earlier copy
    assert row.state is WorkerState.UNKNOWN and row.state is not WorkerState.DEAD
    assert (row.role, row.index) == (Role.DECODE, 2)  # still listed by /health


def test_a_row_left_mid_write_is_dead_once_the_launcher_marks_it() -> None:
    buf, table = _table(2)
    table.writer(0).claim(Role.PREFILL, 0)
    table.writer(0).set_state(WorkerState.READY)
    _tear(buf, 0)  # what a SIGKILL mid-write leaves
    LoadTable(buf, 2).writer(0).set_state(WorkerState.DEAD)  # the launcher, after reaping
    assert table.snapshot()[0].state is WorkerState.DEAD
    LoadTable(buf, 2).writer(0).claim(Role.PREFILL, 0)
    assert table.snapshot()[0].state is WorkerState.STARTING


def test_header_mismatches_are_typed_errors() -> None:
    buf, _ = _table(2)
    with pytest.raises(LoadTableError, match="2 rows"):
        LoadTable(buf, 1)
    with pytest.raises(LoadTableError, match="needed"):
        LoadTable(bytearray(10), 1)
    with pytest.raises(LoadTableError, match="writable"):
        LoadTable(bytes(LoadTable.layout_nbytes(1)), 1)
    with pytest.raises(LoadTableError, match="at least one"):
        LoadTable.layout_nbytes(0)


# -- across processes ------------------------------------------------------------------

_ROWS = 2
_MIN_WRITES = 20_000
_MAX_WRITES = 2_000_000  # bounds a writer whose reader never gets a core (seconds)
_FINAL = _MAX_WRITES + 1
# The load fields a writer sets to one counter at each publish: a reader that sees them
# differ in one row has read a torn row.
_TORN_FIELDS = (
    "queued_prefill_tokens",
    "waiting_requests",
    "running_requests",
    "free_kv_blocks",
    "total_kv_blocks",
    "requests_received",
    "prompt_tokens_received",
)


def _hammer(path: str, slot: int, go: Any, stop: Any) -> None:
    """Child process: publish rows whose load fields all equal the same counter, from
    when the reader reads until it has seen writes land (at least ``_MIN_WRITES``), then
    ``_FINAL``."""
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 0)
    w = LoadTable(buf, _ROWS).writer(slot)
    w.claim(Role.PREFILL, slot)
    assert go.wait(60)
    k = 0
    while k < _MAX_WRITES and (k < _MIN_WRITES or not stop.is_set()):
        k += 1
        _publish_all(w, k)
    _publish_all(w, _FINAL)


def _publish_all(w: RowWriter, k: int) -> None:
    w.publish(**dict.fromkeys(_TORN_FIELDS, k))


def test_readers_never_see_a_torn_row_while_other_processes_write(tmp_path: Path) -> None:
    path = tmp_path / "table"
    path.write_bytes(bytes(LoadTable.layout_nbytes(_ROWS)))
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 0)
    table = LoadTable(buf, _ROWS)
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    writers = [ctx.Process(target=_hammer, args=(str(path), s, go, stop)) for s in range(_ROWS)]
    for p in writers:
        p.start()
    reads, seen = 0, set()
    go.set()
    while any(p.is_alive() for p in writers) or reads == 0:
        for row in table.snapshot():
            fields = {getattr(row, name) for name in _TORN_FIELDS}
            assert len(fields) == 1, f"torn row {row}"
            seen.add(row.queued_prefill_tokens)
            reads += 1
        if len(seen) > 2 * _ROWS + 2:  # rows seen mid-write, not only at rest
            stop.set()
    for p in writers:
        p.join(10)
        assert p.exitcode == 0
    final = table.snapshot()
    assert all(r.queued_prefill_tokens == _FINAL for r in final)
    # The check raced real writes, not only the rows at rest (0, then _FINAL).
    assert len(seen - {0, _FINAL}) > 2


def test_prefix_cache_figures_travel_in_the_row_after_offset_80() -> None:
    buf, table = _table(1)
    w = table.writer(0)
    w.claim(Role.PREFILL, 0, pid=1)
    w.publish(cached_blocks=77, prefix_hit_tokens=1 << 40, prefix_queried_tokens=(1 << 41) + 5)
    row = LoadTable(buf, 1).snapshot()[0]
    assert (row.cached_blocks, row.prefix_hit_tokens, row.prefix_queried_tokens) == (
        77,
        1 << 40,
        (1 << 41) + 5,
    )
    assert lt.ROW_DTYPE.fields is not None and lt.ROW_DTYPE.fields["cached_blocks"][1] == 80


def test_a_worker_that_died_before_claiming_its_row_is_named_by_the_launcher() -> None:
    buf, table = _table(2)
    table.writer(1).mark_exited(WorkerState.FAILED, -9, Role.DECODE, 1)  # SIGKILL
    row = LoadTable(buf, 2).snapshot()[1]
    assert (row.role, row.index, row.state) == (Role.DECODE, 1, WorkerState.FAILED)
    assert row.exit_status == -9
    w = table.writer(0)  # a claimed row keeps its own name
    w.claim(Role.PREFILL, 0, pid=1234)
    w.mark_exited(WorkerState.DEAD, 1, Role.DECODE, 5)
    row = LoadTable(buf, 2).snapshot()[0]
    assert (row.role, row.index, row.state) == (Role.PREFILL, 0, WorkerState.DEAD)


# -- the node a worker runs on -----------------------------------------------------------


def test_a_claimed_node_name_reads_back_and_a_reclaim_replaces_it() -> None:
    buf, table = _table(2)
    w = table.writer(1)
    w.claim(Role.DECODE, 3, pid=1, node="gpu-host-7")
    w.publish(running_requests=2)  # every write keeps the name
    row = LoadTable(buf, 2).snapshot()[1]
    assert (row.node, row.running_requests) == ("gpu-host-7", 2)
    assert table.snapshot()[0].node == ""  # an unclaimed row names no node
    w.claim(Role.DECODE, 3, pid=2, node="b")
    assert table.snapshot()[1].node == "b"
    w.claim(Role.DECODE, 3, pid=3)  # a claim without a name names none
    assert table.snapshot()[1].node == ""


def test_node_names_take_up_to_64_bytes_of_utf8_and_no_more() -> None:
    _, table = _table(1)
    w = table.writer(0)
    longest = "é" * 32  # 64 bytes
    w.claim(Role.PREFILL, 0, node=longest)
    assert table.snapshot()[0].node == longest
    for name in ("é" * 33, "x" * 65):
        with pytest.raises(ValueError, match="at most 64"):
            w.claim(Role.PREFILL, 0, node=name)
    with pytest.raises(ValueError, match="NUL"):
        w.claim(Role.PREFILL, 0, node="a\0b")
    assert table.snapshot()[0].node == longest  # a refused claim wrote nothing


def test_the_launcher_marking_a_death_keeps_the_node_and_a_torn_row_still_names_it() -> None:
    buf, table = _table(1)
    w = table.writer(0)
    w.claim(Role.DECODE, 0, pid=5, node="b0")
    LoadTable(buf, 1).writer(0).mark_exited(WorkerState.DEAD, -9, Role.DECODE, 0)
    row = table.snapshot()[0]
    assert (row.state, row.node) == (WorkerState.DEAD, "b0")
    _tear(buf, 0)
    unknown = LoadTable(buf, 1).snapshot()[0]  # a reader with no earlier copy
    assert (unknown.state, unknown.node) == (WorkerState.UNKNOWN, "b0")


def test_a_mirrored_row_is_named_by_the_caller_and_rows_cross_without_a_name() -> None:
    _, here = _table(1)
    w = here.writer(0)
    w.claim(Role.DECODE, 4, pid=9, node="member-local-name")
    w.set_state(WorkerState.READY)
    row = here.snapshot()[0]
    fields = lt.row_fields(row)
    assert "node" not in fields and all(isinstance(v, int) for v in fields.values())
    crossed = lt.row_from_fields(-1, fields)
    assert crossed.node == ""
    with pytest.raises(ValueError, match=r"unknown.*node"):
        lt.row_from_fields(-1, {**fields, "node": 1})
    _, head = _table(2)
    head.writer(1).mirror(crossed, time.monotonic_ns(), "b1")
    mirrored = head.snapshot()[1]
    assert (mirrored.role, mirrored.index, mirrored.node) == (Role.DECODE, 4, "b1")
    with pytest.raises(ValueError, match="at most 64"):
        head.writer(1).mirror(crossed, time.monotonic_ns(), "n" * 65)


def test_a_table_of_the_previous_layout_is_refused() -> None:
    buf, _ = _table(1)
    struct.pack_into("<I", buf, 8, lt._VERSION - 1)  # a v4 writer: 128-byte rows, no node
    with pytest.raises(LoadTableError, match=f"not a v{lt._VERSION} load table"):
        LoadTable(buf, 1)
