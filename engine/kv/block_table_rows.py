"""Persistent block tables for the kernel path: one row per live sequence, kept on device.

The torch path builds a padded (B, max_blocks) table from Python lists every step. Here
each sequence owns a row of one ``(rows, width)`` int32 table for as long as it lives;
a step names its sequences' rows (``seq_rows``) and sends only the block ids that are new
since the last step, as (flat index, block) pairs that ride in the step's one host ->
device copy (``engine.cuda.graphs.StepInputs``) and are scattered into the table there.

Who calls what: the kernel path calls ``row`` for each sequence of a step (collecting the
updates), ``release`` when the runner frees a sequence's blocks, ``reset`` after the
profiling forwards. A sequence that is dropped without ``release`` (a prefill worker's
exported sequence, whose blocks now belong to the transfer) gives its row back when it is
garbage-collected (weakref), so rows never leak.

NOTE: invariant: between ``release`` calls a sequence's ``block_table`` only grows (what
``KVPool.ensure_blocks`` does). A table that shrank or whose last known block changed
is rewritten whole, so a violation costs a bigger copy, never a wrong read.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

PAD_ROW = 0  # never handed out: padding rows of a CUDA-graph batch point here (ctx_len 0)


@dataclass(eq=False)
class _Row:
    index: int  # into the table's first axis
    key: int  # id() of the sequence
    ref: weakref.ref[object] = field(init=False)
    written: int = 0  # leading entries of the sequence's block_table already on device
    last: int = -1  # block_table[written - 1] when written was set


class BlockTableRows:
    def __init__(self, width: int, capacity: int, device: torch.device) -> None:
        assert capacity >= 2, "row 0 is the padding row"
        self.width = width
        self.device = device
        self.table = torch.zeros(capacity, width, dtype=torch.int32, device=device)
        # Bumped whenever ``table`` is reallocated: CUDA graphs captured on the old one
        # hold its address and must be recaptured.
        self.generation = 0
        self._rows: dict[int, _Row] = {}  # id(sequence) -> its row
        self._free = list(range(capacity - 1, PAD_ROW, -1))  # pop() hands out 1, 2, ...
        self._dead: list[_Row] = []  # rows of sequences garbage-collected since last drain

    @property
    def num_live(self) -> int:
        return len(self._rows)

    def row(self, seq: object, block_table: list[int], updates: list[int]) -> int:
        """``seq``'s row, claiming one on first sight. Appends ``flat index, block`` pairs
        (flattened, into ``updates``) for entries of ``block_table`` the device lacks."""
        n = len(block_table)
        if n > self.width:
            raise ValueError(f"{n} blocks exceed the block table's width {self.width}")
        self._drain_dead()
        key = id(seq)
        entry = self._rows.get(key)
        if entry is None or entry.ref() is not seq:
            entry = self._claim(seq, key)
        start = entry.written
        if n < start or (start and block_table[start - 1] != entry.last):
            start = 0  # the table was replaced, not grown: rewrite it
        base = entry.index * self.width
        for col in range(start, n):
            updates += (base + col, block_table[col])
        if n:
            entry.written, entry.last = n, block_table[n - 1]
        return entry.index

    def release(self, seq: object) -> None:
        """``seq``'s blocks are gone: its row is free for another sequence."""
        entry = self._rows.get(id(seq))
        if entry is not None and entry.ref() is seq:
            self._free_entry(entry)

    def forget_written(self) -> None:
        """A step failed between collecting and uploading updates: resend every row."""
        for entry in self._rows.values():
            entry.written, entry.last = 0, -1

    def reset(self) -> None:
        """Drop every row (after the profiling forwards: their sequences are gone)."""
        for entry in list(self._rows.values()):
            self._free_entry(entry)
        self._dead.clear()

    def _claim(self, seq: object, key: int) -> _Row:
        stale = self._rows.pop(key, None)
        if stale is not None:  # a dead sequence whose id() was reused before the drain
            self._free.append(stale.index)
        if not self._free:
            self._grow()
        entry = _Row(index=self._free.pop(), key=key)
        dead = self._dead  # NOTE: not self: the callback must not keep this object alive
        entry.ref = weakref.ref(seq, lambda _: dead.append(entry))
        self._rows[key] = entry
        return entry

    def _free_entry(self, entry: _Row) -> None:
        if self._rows.get(entry.key) is entry:
            del self._rows[entry.key]
            self._free.append(entry.index)

    def _drain_dead(self) -> None:
        while self._dead:
            self._free_entry(self._dead.pop())

    def _grow(self) -> None:
        old = self.table
        cap = old.shape[0]
        self.table = torch.zeros(2 * cap, self.width, dtype=torch.int32, device=self.device)
        self.table[:cap].copy_(old)  # device to device, queued like the step's kernels
        self._free.extend(range(2 * cap - 1, cap - 1, -1))
        self.generation += 1
