"""A worker's heartbeat while one long step runs.

A worker publishes its load-table row once a step, and the router takes a row whose
heartbeat is older than its staleness bound (a quarter of ``--stall-timeout``, 5 s by
default) for a dead worker: no new request goes there, and with no other worker of the role
a request gets 503 "no live ... worker". One CPU step of a larger model can outlast that
(a 2048-token prefill chunk of a 360M model in Q8_0, under 32 queued streams, on 2 cores):
a busy worker was taken for a dead one. Here a second thread refreshes the heartbeat
while a step runs, for at most ``STEP_BEAT_S`` of one step: a step longer than that is taken
as hung, so the stall timeout still moves a hung worker's requests. A stopped process
(SIGSTOP) beats from no thread.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

# How long into one step the heartbeat is kept: far above any step measured (a 2048-token
# chunk of a 0.5B model on 2 cores takes a few seconds), so only a hang outlasts it.
STEP_BEAT_S = 60.0


class Publishes(Protocol):
    def publish(self) -> None:
        """Write the row again (its heartbeat now), every other value as it was."""


class StepBeat:
    """``start``/``end`` around each step on the worker's thread; a daemon thread
    publishes the row every ``interval_s`` while steps run (none past ``limit_s`` into one
    step), and sleeps on an event while none runs."""

    def __init__(self, row: Publishes, interval_s: float, limit_s: float = STEP_BEAT_S) -> None:
        self._row, self._interval_s, self._limit_s = row, interval_s, limit_s
        self._started: float | None = None  # monotonic start of the step now running
        self._stepping = threading.Event()
        self.beats = 0  # how many heartbeats this thread added (for tests and logs)
        threading.Thread(target=self._run, name="step-beat", daemon=True).start()

    def start(self) -> None:
        self._started = time.monotonic()
        self._stepping.set()

    def end(self) -> None:
        self._started = None
        self._stepping.clear()

    def _run(self) -> None:
        while True:
            self._stepping.wait()
            time.sleep(self._interval_s)
            started = self._started
            if started is not None and time.monotonic() - started < self._limit_s:
                self._row.publish()
                self.beats += 1
