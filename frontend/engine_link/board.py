"""What several frontend processes share: one shared-memory segment, a row per frontend.

``launch --api-workers N`` starts N frontends; each owns its requests, but admission
bounds, ``/health`` and ``/metrics`` are the server's, not one process's. Each frontend
publishes here what the others need to give the same answers.

Who does what:
    launcher    creates the segment (``layout_nbytes``, ``format``) before any child
                starts, like every ring; marks a reaped frontend's row DEAD (``mark_dead``)
                and reads ``all_ready`` while it waits for the server to come up; reads
                which worker deaths the frontends explained (``explained``) and writes
                when a worker in crash-loop back-off will be retried (``set_retry_at``).
    frontend n  ``claim(n)`` at start (pid, incarnation, STARTING), ``set_state(READY)``
                once it serves; then writes only its own row: its active requests per
                detokenizer shard, its router's books per worker slot (``PeerBooks``,
                ``router/ledger.py``) and its metric values (``frontend/telemetry``).
                It reads every row. A request it ends as poison names the pids of the
                worker deaths it explains (``explain_deaths``).

Row n:
    meta[24]      pid, state (transport.load_table.WorkerState), incarnation, explained
                  deaths so far, then the pids of the last ``EXPLAINED`` of them (a ring)
    active[K]     requests of frontend n per detokenizer shard
    books[W, 8]   per load-table slot: generation, sent requests, sent tokens, reserved
                  requests, reserved tokens, assigned requests, assigned tokens
    metrics[M]    float64 metric values, laid out by frontend/telemetry/metrics.py
After the rows, the launcher's words:
    retry_at[W + K]  per load-table slot, then per detokenizer shard: the wall-clock time
                  (Unix seconds) a worker in crash-loop back-off is started again; 0: none

NOTE: every word has one writer (its row's frontend; the launcher writes ``state`` only
of a frontend it has reaped, and its own words after the rows), and every value is an
aligned 8-byte word written with one store, so a reader never sees a torn word. It may see one word of a row newer than
another (sent requests updated, sent tokens not yet): admission, /health and /metrics
are advisory figures and tolerate being one request off for one read. A frontend that
restarts goes on from its predecessor's cumulative figures (books, metrics), so the
server's sums never go backwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from router.ledger import Cell, InFlight
from transport.load_table import WorkerState

_MAGIC = 0x70647366_726F6E74  # "pdsfront"
_HEADER = 128
_META = 24
_PID, _STATE, _INCARNATION, _EXPLAINED = 0, 1, 2, 3
EXPLAINED = 16  # explained deaths a frontend's row remembers (the launcher reads them within 1 s)
_CELL = 8
_GEN, _SENT_REQ, _SENT_TOK, _RES_REQ, _RES_TOK, _ASG_REQ, _ASG_TOK = range(7)
METRIC_WORDS = 128  # float64 words of metrics per frontend (telemetry checks it fits)


@dataclass(frozen=True)
class FrontendRow:
    """One frontend as ``/health`` reports it."""

    index: int
    pid: int
    state: WorkerState
    active: int  # its requests in flight


class FrontendBoard:
    """A view of the board; ``me`` is this process's row (None: the launcher's view)."""

    def __init__(self, buf: memoryview | bytearray, me: int | None = None) -> None:
        header = np.ndarray((5,), np.int64, buf, 0)
        magic, n, k, w, m = (int(x) for x in header)
        if magic != _MAGIC or m != METRIC_WORDS:
            raise ValueError("not a formatted frontend board (or of another version)")
        self.num_frontends, self.num_shards, self.num_workers = n, k, w
        ints, stride = _row_words(k, w), _row_bytes(k, w)
        # (N, words) views over every row, rows ``stride`` bytes apart.
        self._ints = np.ndarray((n, ints), np.int64, buf, _HEADER, (stride, 8))
        self.metrics = np.ndarray((n, m), np.float64, buf, _HEADER + 8 * ints, (stride, 8))
        self._books = self._ints[:, _META + k :].reshape(n, w, _CELL)
        self._retry_at = np.ndarray((w + k,), np.float64, buf, _HEADER + n * stride)
        self.me = me
        self._buf = buf
        if me is not None and not 0 <= me < n:
            raise ValueError(f"frontend {me} has no row on a board of {n}")

    # ---- layout (launcher) -------------------------------------------------------------

    @staticmethod
    def layout_nbytes(num_frontends: int, num_shards: int, num_workers: int) -> int:
        rows = num_frontends * _row_bytes(num_shards, num_workers)
        return _HEADER + rows + 8 * (num_workers + num_shards)

    @staticmethod
    def format(
        buf: memoryview | bytearray, num_frontends: int, num_shards: int, num_workers: int
    ) -> None:
        """Write the header of a zero-filled board."""
        header = np.ndarray((5,), np.int64, buf, 0)
        header[:] = (_MAGIC, num_frontends, num_shards, num_workers, METRIC_WORDS)

    @classmethod
    def private(cls, num_shards: int = 0, num_workers: int = 0) -> FrontendBoard:
        """A board of one frontend in process memory: a server of one frontend in tests."""
        buf = bytearray(cls.layout_nbytes(1, num_shards, num_workers))
        cls.format(buf, 1, num_shards, num_workers)
        return cls(buf, me=0)

    # ---- frontend rows -----------------------------------------------------------------

    def claim(self) -> int:
        """Take this process's row (a restart takes its predecessor's); its incarnation."""
        row = self._ints[self._mine]
        row[_INCARNATION] += 1
        row[_PID] = os.getpid()
        row[_STATE] = WorkerState.STARTING
        # A predecessor's reservations are orphans (its requests died with it); its sent
        # and assigned counts go on.
        self._books[self._mine, :, _RES_REQ] = 0
        self._books[self._mine, :, _RES_TOK] = 0
        return int(row[_INCARNATION])

    def set_state(self, state: WorkerState) -> None:
        self._ints[self._mine, _STATE] = state

    def mark_dead(self, index: int, failed: bool = False) -> None:
        """The launcher reaped frontend ``index``."""
        self._ints[index, _STATE] = WorkerState.FAILED if failed else WorkerState.DEAD

    def frontends(self) -> list[FrontendRow]:
        rows = self._ints.copy()
        actives = rows[:, _META : _META + self.num_shards].sum(axis=1)
        return [
            FrontendRow(i, int(r[_PID]), _state(int(r[_STATE])), int(a))
            for i, (r, a) in enumerate(zip(rows, actives, strict=True))
        ]

    def all_ready(self) -> bool:
        return bool((self._ints[:, _STATE] == WorkerState.READY).all())

    def explain_deaths(self, pids: list[int]) -> None:
        """This frontend ended a request as poison: the deaths of ``pids`` were its doing."""
        row = self._ints[self._mine]
        for pid in pids:
            n = int(row[_EXPLAINED])
            row[_META - EXPLAINED + n % EXPLAINED] = pid
            row[_EXPLAINED] = n + 1  # after the pid: a reader never sees a count ahead of it

    def explained(self) -> set[int]:
        """The pids of the deaths any frontend explained lately (``EXPLAINED`` each)."""
        return {int(p) for p in self._ints[:, _META - EXPLAINED : _META].ravel() if p > 0}

    def set_retry_at(self, index: int, when: float) -> None:
        """The launcher: worker ``index`` (a load-table slot, or ``num_workers`` + a shard)
        is started again at Unix time ``when``; 0: it is not in back-off."""
        self._retry_at[index] = when

    def retry_at(self, index: int) -> float:
        return float(self._retry_at[index])

    def set_active(self, per_shard: list[int]) -> None:
        """This frontend's requests in flight per detokenizer shard."""
        self._ints[self._mine, _META : _META + self.num_shards] = per_shard

    def active_per_shard(self) -> list[int]:
        """Every live frontend's requests in flight per shard, summed."""
        live = self._ints[:, _STATE] == WorkerState.READY
        return [int(x) for x in self._ints[live, _META : _META + self.num_shards].sum(axis=0)]

    # ---- router books (router.ledger.PeerBooks) ------------------------------------------

    def own(self, slot: int) -> Cell | None:
        c = self._books[self._mine, slot]
        if not c.any():
            return None
        return Cell(*(int(x) for x in c[:7]))

    def others(self, slot: int, generation: int) -> InFlight:
        cells = self._books[:, slot]
        mine = np.arange(self.num_frontends) == self._mine
        same = (cells[:, _GEN] == generation) & ~mine
        # A dead frontend's reservations are orphans now, their KV counted by the worker
        # itself; what it sent stays counted: the worker has received (or will) those.
        live = same & (self._ints[:, _STATE] == WorkerState.READY)
        return InFlight(
            int(cells[same, _SENT_REQ].sum()),
            int(cells[same, _SENT_TOK].sum()),
            int(cells[live, _RES_REQ].sum()),
            int(cells[live, _RES_TOK].sum()),
        )

    def publish(self, slot: int, cell: Cell) -> None:
        self._books[self._mine, slot, :7] = (
            cell.generation,
            cell.sent_requests,
            cell.sent_tokens,
            cell.reserved_requests,
            cell.reserved_tokens,
            cell.assigned_requests,
            cell.assigned_tokens,
        )

    def assigned(self, slot: int) -> tuple[int, int]:
        cells = self._books[:, slot]
        return int(cells[:, _ASG_REQ].sum()), int(cells[:, _ASG_TOK].sum())

    # ---- metrics -----------------------------------------------------------------------

    def my_metrics(self) -> memoryview[float]:
        """This frontend's metric words as a writable float64 memoryview (fast ``+=``)."""
        return memoryview(self.metrics[self._mine]).cast("B").cast("d")

    @property
    def _mine(self) -> int:
        assert self.me is not None, "the launcher's view has no row of its own"
        return self.me


def _row_words(num_shards: int, num_workers: int) -> int:
    return _META + num_shards + num_workers * _CELL


def _row_bytes(num_shards: int, num_workers: int) -> int:
    nbytes = 8 * (_row_words(num_shards, num_workers) + METRIC_WORDS)
    return -(-nbytes // 128) * 128  # rows on their own cache lines


def _state(value: int) -> WorkerState:
    try:
        return WorkerState(value)
    except ValueError:
        return WorkerState.UNKNOWN
