"""The load table: one shared-memory row per worker, written by it, read by the router.

Who does what:
    launcher   creates the segment and constructs ``LoadTable(buf, n)`` first (that
               writes the header); may mark a slot DEAD after it has reaped the worker.
    worker     ``w = table.writer(slot)``; ``w.claim(role, index, node=...)`` once at start
               (new generation); ``w.publish(...)`` every step, ~400 ms idle and ~400 ms in
               a long step (``runtime/step_beat.py``), ``w.set_state(...)`` on transitions.
    frontend   ``table.snapshot()`` before each placement (router) and for /health.

Liveness is the launcher's word, never a reader's guess: a row that stays mid-write past
the read deadline (its writer preempted, or killed mid-write and not yet reaped) is
reported from the reader's last consistent copy of it, or as UNKNOWN if it has none; the
launcher marks a reaped worker DEAD, and that write makes the row readable again.

Layout: a 64-byte header, then ``num_workers`` rows of 192 bytes (three cache lines, so a
worker's stores never share a line with its neighbours'), then the engine workers' core
lease (``transport/core_lease.py``). A row is the seq word, the integer payload, then the
worker's node name (``NODE_NBYTES`` of UTF-8, NUL-padded), under its own seqlock: the
writer makes ``seq`` odd, writes the payload, makes ``seq`` even; a reader accepts a copy
only if ``seq`` was even and unchanged around it, so it never sees a torn row.

Memory ordering. A seqlock needs the writer's stores ordered (seq-odd before payload before
seq-even) and the reader's loads ordered (seq before payload before seq). x86-64 is TSO:
stores reach other cores in program order and loads are not reordered with loads, and every
access here happens inside a separate opaque C call, which the C compiler cannot reorder
across. So on x86-64 plain accesses suffice. aarch64 may reorder both; there we need real
barriers, taken from ``transport._atomics`` (C ``__atomic`` builtins): the writer does
store(seq odd); fence; payload; store_release(seq even), the reader load_acquire(seq);
payload; fence; load_acquire(seq). When that extension is not built, the table falls back
to plain accesses and logs a warning on non-x86 machines: rows are then advisory, and a
reordered read could be torn. The helper runs on x86-64 too when present (two C calls
a publish): both architectures run the same code.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from transport.core_lease import CoreLease, lease_nbytes
from transport.seqlock import fence, load_acquire, store_release
from transport.worker_load import LOAD_FIELDS, SPECULATION_FIELDS, WorkerLoad
from wire.roles import Role

logger = logging.getLogger(__name__)


class WorkerState(enum.IntEnum):
    EMPTY = 0  # never claimed (a zero-filled row reads as this)
    STARTING = 1  # loading the model; not routable yet
    READY = 2
    DRAINING = 3  # finishing what it has; takes nothing new
    DEAD = 4  # reaped by the launcher (or a row whose role/state bytes are garbage)
    FAILED = 5  # died repeatedly: the launcher stopped restarting it (exit_status says how)
    # Reader-side only, never written: a row torn on every read so far (its writer is
    # mid-write). Not routable, and not dead either.
    UNKNOWN = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRow(WorkerLoad):
    """One consistent copy of a row: who the worker is, and its load (``WorkerLoad``)."""

    slot: int
    role: Role | None  # None: a slot no worker has claimed yet
    index: int
    pid: int
    state: WorkerState
    generation: int
    heartbeat_ns: int  # time.monotonic_ns() of the last publish (CLOCK_MONOTONIC, host-wide)
    block_size: int
    exit_status: int = 0  # of the last exit the launcher saw: a code, or -signal
    # The node (host) the worker runs on: what its worker claimed with, or, for a row
    # mirrored from another host, the name that host joined the cluster with. "" from a
    # writer that named none (a row the launcher marked before its worker claimed it).
    node: str = ""

    @property
    def worker(self) -> tuple[Role, int]:
        """(role, index) of a claimed row: how the router and /metrics key a worker."""
        assert self.role is not None, f"load-table slot {self.slot} is unclaimed"
        return self.role, self.index


def describe_exit(status: int) -> str:
    """``exit_status`` in words, for logs and /health."""
    if status >= 0:
        return f"exited with code {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    if -status == signal.SIGKILL:
        return f"killed by {name} (possibly the kernel's OOM killer: check dmesg)"
    return f"killed by {name}"


HEADER_NBYTES = 64
ROW_NBYTES = 384  # a multiple of 64 (whole cache lines) and of 8 (aligned seq words)
NODE_NBYTES = 64  # a node name's room in a row: UTF-8, NUL-padded (Linux host names fit)
_MAGIC = 0x7064_6C6F_6164_7462  # "pdloadtb"
_VERSION = 8  # 8: rows of 384 bytes, + LoRA counters and the prefix-cache reset epoch
_HEADER = struct.Struct("<QII")  # magic, version, num_workers
# Row payload after the 8-byte seq, packed in one call by the writer. The numpy dtype below
# names the same bytes for the reader; test_load_table pins that the two agree.
_PAYLOAD = struct.Struct("<qqqqIiiiiiiiBBxxiixxxxqqqqq" + "q" * len(SPECULATION_FIELDS) + "q")
_PAYLOAD_FIELDS = (
    "heartbeat_ns",
    "queued_prefill_tokens",
    "prompt_tokens_received",
    "requests_received",
    "generation",
    "pid",
    "index",
    "waiting_requests",
    "running_requests",
    "free_kv_blocks",
    "total_kv_blocks",
    "block_size",
    "role",
    "state",
    "exit_status",
    "cached_blocks",
    "prefix_hit_tokens",
    "prefix_queried_tokens",
    "computed_prefill_tokens",
    "lora_adapters",
    "lora_loads",
    *SPECULATION_FIELDS,
    "prefix_reset_epoch",
)
# The node name follows the integers; the writer packs both in one call (``_ROW``).
_NODE_OFFSET = 8 + _PAYLOAD.size
_ROW = struct.Struct(f"{_PAYLOAD.format}{NODE_NBYTES}s")
_FORMATS = ["<u8", *["<i8"] * 4, "<u4", *["<i4"] * 7, "u1", "u1", "<i4", "<i4", *["<i8"] * 5]
_OFFSETS = [0, 8, 16, 24, 32, 40, 44, 48, 52, 56, 60, 64, 68, 72, 73, 76, 80, 88, 96, 104, 112, 120]
_FORMATS += ["<i8"] * len(SPECULATION_FIELDS)
_OFFSETS += range(128, 128 + 8 * len(SPECULATION_FIELDS), 8)
_FORMATS.append("<i8")
_OFFSETS.append(128 + 8 * len(SPECULATION_FIELDS))
ROW_DTYPE = np.dtype(
    {
        "names": ["seq", *_PAYLOAD_FIELDS, "node"],
        "formats": [*_FORMATS, f"S{NODE_NBYTES}"],
        "offsets": [*_OFFSETS, _NODE_OFFSET],
        "itemsize": ROW_NBYTES,
    }
)
assert _NODE_OFFSET + NODE_NBYTES <= ROW_NBYTES
_SPIN_READS = 64  # retries before yielding the CPU to a (possibly preempted) writer
# A row still torn after this is reported from its last consistent copy. Under load a
# writer can be preempted mid-write for longer (seen at startup on 2 busy cores).
_MAX_READ_NS = 2_000_000


class LoadTableError(ValueError):
    """The buffer does not hold a load table of the expected shape."""


def encode_node(name: str) -> bytes:
    """``name`` as a row stores it; ``ValueError`` if its UTF-8 exceeds ``NODE_NBYTES`` or
    holds a NUL (the padding: a name cut at one would read back as another)."""
    raw = name.encode()
    if len(raw) > NODE_NBYTES:
        raise ValueError(
            f"node name {name!r} is {len(raw)} bytes of UTF-8; at most "
            f"{NODE_NBYTES} fit in a load-table row"
        )
    if b"\0" in raw:
        raise ValueError(f"node name {name!r} holds a NUL character")
    return raw


class LoadTable:
    """A view of the table over ``buf`` (any writable buffer: mmap, memoryview, bytearray).

    The first constructor over a zero-filled buffer writes the header; later ones (in other
    processes) check it. ``buf`` must stay alive and mapped as long as the table is used.
    """

    @staticmethod
    def layout_nbytes(num_workers: int) -> int:
        if num_workers < 1:
            raise LoadTableError(f"a load table needs at least one row, got {num_workers}")
        return HEADER_NBYTES + num_workers * ROW_NBYTES + lease_nbytes(num_workers)

    def __init__(self, buf: Any, num_workers: int) -> None:
        view = memoryview(buf).cast("B")
        if view.readonly:
            raise LoadTableError("the load table needs a writable buffer")
        need = self.layout_nbytes(num_workers)
        if view.nbytes < need:
            raise LoadTableError(f"buffer of {view.nbytes} bytes, {need} needed")
        self._view = view
        self.num_workers = num_workers
        self._init_or_check_header()
        self._rows = np.frombuffer(view, ROW_DTYPE, num_workers, HEADER_NBYTES)
        # NOTE: the array keeps the buffer exported, so these addresses stay valid.
        base = self._rows.__array_interface__["data"][0]
        assert base % 8 == 0, "seq words must be 8-byte aligned for atomic access"
        self._seq_addrs = [base + i * ROW_NBYTES for i in range(num_workers)]
        # This reader's last consistent copy of each row, reported while a row is torn.
        self._last: list[LoadRow | None] = [None] * num_workers

    def _init_or_check_header(self) -> None:
        magic, version, n = _HEADER.unpack_from(self._view, 0)
        if magic == 0:
            _HEADER.pack_into(self._view, 0, _MAGIC, _VERSION, self.num_workers)
            return
        if magic != _MAGIC or version != _VERSION:
            raise LoadTableError(f"not a v{_VERSION} load table (magic {magic:#x}, v{version})")
        if n != self.num_workers:
            raise LoadTableError(f"table has {n} rows, caller expects {self.num_workers}")

    def core_lease(self, slot: int, cores: int) -> CoreLease:
        """Slot ``slot``'s handle on the engine workers' shared core lease (after the rows)."""
        start = HEADER_NBYTES + self.num_workers * ROW_NBYTES
        region = self._view[start : start + lease_nbytes(self.num_workers)]
        return CoreLease(region, self.num_workers, slot, cores)

    def writer(self, slot: int) -> RowWriter:
        if not 0 <= slot < self.num_workers:
            raise IndexError(f"slot {slot} outside 0..{self.num_workers - 1}")
        return RowWriter(self._view, HEADER_NBYTES + slot * ROW_NBYTES, self._seq_addrs[slot])

    def snapshot(self) -> list[LoadRow]:
        """A consistent copy of every row, indexed by slot."""
        out: list[LoadRow | None] = [None] * self.num_workers
        pending = list(range(self.num_workers))
        deadline = time.monotonic_ns() + _MAX_READ_NS
        attempt = 0
        while pending:
            pending = self._read_pass(pending, out)
            attempt += 1
            if pending and attempt >= _SPIN_READS:
                if time.monotonic_ns() > deadline:
                    for s in pending:
                        load = self._last[s] or self._unknown(s)
                        logger.debug(
                            "load-table row %d stayed mid-write; reporting it as %s",
                            s,
                            load.state.name,
                        )
                        out[s] = load
                    break
                os.sched_yield()
        return [load for load in out if load is not None]

    def _unknown(self, slot: int) -> LoadRow:
        """A row never read consistently: who it is (role and index are rewritten with the
        same values by every write of a generation), but no load and state UNKNOWN."""
        row = self._rows[slot].tolist()
        loaded = _to_load(slot, row)
        zeros = dict.fromkeys(_PAYLOAD_FIELDS, 0)
        del zeros["role"], zeros["state"], zeros["index"], zeros["pid"], zeros["generation"]
        # The node, like the role and index, is written once per generation.
        return LoadRow(
            slot=slot,
            role=loaded.role,
            index=loaded.index,
            pid=loaded.pid,
            generation=loaded.generation,
            state=WorkerState.UNKNOWN,
            node=loaded.node,
            **zeros,
        )

    def _read_pass(self, slots: list[int], out: list[LoadRow | None]) -> list[int]:
        """Read ``slots`` under their seqlocks; fill ``out``; return the slots to retry."""
        before = [load_acquire(self._seq_addrs[s], self._rows, s) for s in slots]
        rows = self._rows.copy().tolist()  # one memcpy of the table, then plain tuples
        fence()
        retry = []
        for s, s1 in zip(slots, before, strict=True):
            if s1 & 1 or load_acquire(self._seq_addrs[s], self._rows, s) != s1:
                retry.append(s)
            else:
                out[s] = self._last[s] = _to_load(s, rows[s])
        return retry


class RowWriter:
    """The only writer of one row (one write at a time: a second thread may ``publish``).
    Keeps the row's values locally and republishes them whole."""

    def __init__(self, view: memoryview, offset: int, seq_addr: int) -> None:
        self._lock = threading.Lock()
        self._view = view
        self._offset = offset
        self._seq_addr = seq_addr
        self._seq_view = np.frombuffer(view, np.uint64, 1, offset)
        *old, node = _ROW.unpack_from(view, offset + 8)
        self._values: dict[str, int] = dict(zip(_PAYLOAD_FIELDS, old, strict=True))
        # Kept across a reattach, so the launcher's mark_exited leaves the name in place.
        self._node: bytes = node.rstrip(b"\0")

    @property
    def generation(self) -> int:
        return self._values["generation"]

    def claim(
        self,
        role: Role,
        index: int,
        pid: int | None = None,
        block_size: int = 0,
        node: str = "",
    ) -> int:
        """Take the slot for a (re)started worker: a new generation, state STARTING, no load.

        ``node`` names the host the worker runs on (``ValueError`` if it does not fit, see
        ``encode_node``). Returns the new generation. A writer that died mid-write left
        ``seq`` odd; the next write makes it even again, so a reclaimed slot becomes readable.
        """
        self._node = encode_node(node)
        gen = (self._values["generation"] + 1) & 0xFFFF_FFFF
        self._values = dict.fromkeys(_PAYLOAD_FIELDS, 0)
        self._values.update(
            generation=gen,
            role=role.table_code,
            index=index,
            pid=os.getpid() if pid is None else pid,
            block_size=block_size,
            state=int(WorkerState.STARTING),
        )
        self._write()
        return gen

    def publish(self, load: WorkerLoad | None = None, **fields: int) -> None:
        """Refresh the heartbeat and the load: all of ``load``'s fields if given, then any
        ``WorkerLoad`` field named in ``fields``; the others keep their last value."""
        if load is not None:
            self._values.update((name, getattr(load, name)) for name in LOAD_FIELDS)
        unknown = fields.keys() - _LOAD_FIELD_SET
        if unknown:
            raise TypeError(f"not load fields: {sorted(unknown)}")
        self._values.update(fields)
        self._write()

    def set_state(self, state: WorkerState) -> None:
        self._values["state"] = int(state)
        self._write()

    def mirror(self, row: LoadRow, heartbeat_ns: int, node: str) -> None:
        """Copy a row another host's worker published, as that node's gateway does here:
        the heartbeat is given in this host's clock and the pid is the gateway's own, so a
        reader's staleness and pid checks keep their meaning for a remote worker (it is
        reachable while the gateway lives; its state says whether it runs). ``node`` is the
        name that host joined with: the caller's word, never ``row.node`` (rows cross hosts
        as integers only, ``row_fields``)."""
        assert row.role is not None, "only claimed rows are mirrored"
        self._node = encode_node(node)
        self._values.update(row_fields(row), pid=os.getpid())
        self._write(heartbeat_ns)

    def mark_exited(self, state: WorkerState, status: int, role: Role, index: int) -> None:
        """The launcher's record of a death: DEAD (restarting) or FAILED, and how it died.

        A worker that died before claiming its row (in its imports or bootstrap) left the
        row unnamed; the launcher names it here, so readers see that death rather than a
        worker that is still starting.
        """
        if self._values["role"] == 0:  # unclaimed
            self._values.update(role=role.table_code, index=index)
        self._values["exit_status"] = status
        self.set_state(state)

    def _write(self, heartbeat_ns: int | None = None) -> None:
        with self._lock:  # the time taken inside: heartbeats never go back
            now = time.monotonic_ns() if heartbeat_ns is None else heartbeat_ns
            self._values["heartbeat_ns"] = now
            # Odd (even -> odd, or a dead writer's odd -> next odd): readers back off.
            seq = (int(self._seq_view[0]) + 1) | 1
            self._seq_view[0] = seq
            fence()
            _ROW.pack_into(self._view, self._offset + 8, *self._values.values(), self._node)
            store_release(self._seq_addr, self._seq_view, seq + 1)


_STATES = {int(st): st for st in WorkerState}
_LOAD_FIELD_SET = frozenset(LOAD_FIELDS)  # publish checks named fields against it, each step
# Positions of LoadRow's fields, in order, in a row tuple (seq, payload, then the node).
_LOAD_NAMES = [name for name in LoadRow.__dataclass_fields__ if name != "slot"]
_LOAD_COLUMNS = [1 + [*_PAYLOAD_FIELDS, "node"].index(f) for f in _LOAD_NAMES]
_ROLE_AT, _STATE_AT = _LOAD_NAMES.index("role"), _LOAD_NAMES.index("state")
_NODE_AT = _LOAD_NAMES.index("node")
_ROLE_COL, _STATE_COL = _LOAD_COLUMNS[_ROLE_AT], _LOAD_COLUMNS[_STATE_AT]
# What crosses hosts (``row_fields``): every field but the node, whose name the receiving
# head takes from the member that authenticated, not from what the member says.
_FIELD_NAMES = [name for name in _LOAD_NAMES if name != "node"]


def _to_load(slot: int, row: tuple[int, ...]) -> LoadRow:
    state = _STATES.get(row[_STATE_COL])
    try:
        role = Role.from_table_code(row[_ROLE_COL])
    except ValueError:
        state = None
    if state is None:
        # Corrupt enum bytes mean a foreign or broken writer: never route to it.
        logger.warning("load-table row %d holds an unknown role/state; reporting it DEAD", slot)
        return _unreadable(slot)
    values: list[Any] = [row[c] for c in _LOAD_COLUMNS]
    values[_ROLE_AT], values[_STATE_AT] = role, state
    # numpy hands the S field back without its NUL padding. Only encode_node's names are
    # written, so "replace" matters only for a foreign writer's bytes.
    values[_NODE_AT] = values[_NODE_AT].decode("utf-8", "replace")
    return LoadRow(slot=slot, **dict(zip(_LOAD_NAMES, values, strict=True)))


def row_fields(row: LoadRow) -> dict[str, int]:
    """A claimed row's stored integer fields by name (role and state as their stored
    codes): what crosses hosts in ``wire.link_records.Rows``. Not the node: the head
    names a member's rows after the member (``RowWriter.mirror``)."""
    assert row.role is not None
    out = {name: int(getattr(row, name)) for name in _FIELD_NAMES if name not in ("role", "state")}
    out.update(role=row.role.table_code, state=int(row.state))
    return out


def row_from_fields(slot: int, fields: dict[str, int]) -> LoadRow:
    """The inverse of ``row_fields`` (the row's node is ""); ``ValueError`` if a field is
    missing or unknown (a ``node`` among them)."""
    missing = [name for name in _FIELD_NAMES if name not in fields]
    if missing or set(fields) - set(_FIELD_NAMES):
        raise ValueError(
            f"load row fields: missing {missing}, unknown {sorted(set(fields) - set(_FIELD_NAMES))}"
        )
    role = Role.from_table_code(fields["role"])
    if role is None:
        raise ValueError("an unclaimed row")
    values: dict[str, Any] = dict(fields)
    values.update(role=role, state=WorkerState(fields["state"]))
    return LoadRow(slot=slot, **values)


def _unreadable(slot: int) -> LoadRow:
    zeros = dict.fromkeys(_PAYLOAD_FIELDS, 0)
    del zeros["role"], zeros["state"]
    return LoadRow(slot=slot, role=None, state=WorkerState.DEAD, node="", **zeros)
