"""A worker's heartbeat while one long step runs (runtime/step_beat.py), on a real row of a
load table in shared memory, read as the router reads it."""

from __future__ import annotations

import mmap
import threading
import time

from runtime.step_beat import StepBeat
from transport.load_table import LoadTable, RowWriter, WorkerState
from wire.roles import Role

INTERVAL_S = 0.05


def _row() -> tuple[LoadTable, RowWriter]:
    buf = mmap.mmap(-1, LoadTable.layout_nbytes(1))
    table = LoadTable(buf, 1)
    w = table.writer(0)
    w.claim(Role.PREFILL, 0, block_size=16)
    w.publish(queued_prefill_tokens=512, waiting_requests=3)
    w.set_state(WorkerState.READY)
    return table, w


def test_a_long_step_keeps_the_row_fresh_and_its_values() -> None:
    """While one step runs past many intervals (the step here sleeps, as a kernel call that
    releases the GIL does), the heartbeat keeps moving and the row's load stays as
    published; between steps nothing beats."""
    table, w = _row()
    beat = StepBeat(w, INTERVAL_S)
    before = table.snapshot()[0]
    beat.start()
    time.sleep(12 * INTERVAL_S)  # "the step"
    during = table.snapshot()[0]
    beat.end()
    assert beat.beats >= 5
    assert during.heartbeat_ns - before.heartbeat_ns >= 5 * INTERVAL_S * 1e9
    assert (during.queued_prefill_tokens, during.waiting_requests) == (512, 3)
    assert during.state is WorkerState.READY
    time.sleep(3 * INTERVAL_S)  # let a beat in flight land
    idle = beat.beats
    time.sleep(6 * INTERVAL_S)
    assert beat.beats == idle  # asleep between steps


def test_a_step_past_the_limit_stops_beating_so_a_hang_still_shows() -> None:
    """After ``limit_s`` of one step the thread stops: the row goes stale, as the router
    reads staleness, and the stall timeout can move the worker's requests."""
    table, w = _row()
    beat = StepBeat(w, INTERVAL_S, limit_s=4 * INTERVAL_S)
    beat.start()
    time.sleep(12 * INTERVAL_S)
    last = table.snapshot()[0].heartbeat_ns
    time.sleep(6 * INTERVAL_S)
    assert table.snapshot()[0].heartbeat_ns == last
    beat.end()
    assert 1 <= beat.beats <= 4
    assert time.monotonic_ns() - last > 4 * INTERVAL_S * 1e9  # stale, as the router reads it


def test_beats_and_publishes_from_two_threads_never_tear_a_row() -> None:
    """The row's writer takes one write at a time: a reader never sees a row whose two
    fields published together disagree, while another thread beats as fast as it can."""
    table, w = _row()
    stop = threading.Event()

    def beating() -> None:
        while not stop.is_set():
            w.publish()

    thread = threading.Thread(target=beating)
    thread.start()
    try:
        for i in range(3000):
            w.publish(queued_prefill_tokens=i, waiting_requests=i)
            row = table.snapshot()[0]
            assert row.queued_prefill_tokens == row.waiting_requests
    finally:
        stop.set()
        thread.join(timeout=10)
