"""Persistent block-table rows: claimed once per sequence, grown by updates, given back."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.kv.block_table_rows import PAD_ROW, BlockTableRows


class _Seq:
    def __init__(self, blocks: list[int]) -> None:
        self.block_table = blocks


def _apply(rows: BlockTableRows, updates: list[int]) -> None:
    flat = rows.table.view(-1)
    for i in range(0, len(updates), 2):
        flat[updates[i]] = updates[i + 1]


def test_only_blocks_the_device_lacks_are_sent() -> None:
    rows = BlockTableRows(width=4, capacity=4, device=torch.device("cpu"))
    a, b = _Seq([7, 3]), _Seq([5])
    updates: list[int] = []
    ra, rb = rows.row(a, a.block_table, updates), rows.row(b, b.block_table, updates)
    assert PAD_ROW not in (ra, rb) and ra != rb
    _apply(rows, updates)
    assert rows.table[ra].tolist() == [7, 3, 0, 0] and rows.table[rb].tolist() == [5, 0, 0, 0]

    again: list[int] = []
    assert rows.row(a, a.block_table, again) == ra and again == []  # nothing new
    a.block_table.append(9)
    rows.row(a, a.block_table, again)
    assert again == [ra * 4 + 2, 9]  # the one new block

    a.block_table = [8]  # replaced, not grown (against the invariant): rewritten whole
    rewrite: list[int] = []
    rows.row(a, a.block_table, rewrite)
    assert rewrite == [ra * 4, 8]
    assert not rows.table[PAD_ROW].any()


def test_rows_come_back_on_release_and_when_a_sequence_is_collected() -> None:
    rows = BlockTableRows(width=2, capacity=3, device=torch.device("cpu"))  # 2 usable rows
    a, b = _Seq([1]), _Seq([2])
    ra, rb = rows.row(a, a.block_table, []), rows.row(b, b.block_table, [])
    rows.release(a)
    c = _Seq([3])
    assert rows.row(c, c.block_table, []) == ra
    del b
    gc.collect()  # b dropped without release (an exported prefill sequence)
    d = _Seq([4])
    assert rows.row(d, d.block_table, []) == rb and rows.num_live == 2
    rows.reset()
    assert rows.num_live == 0


def test_table_grows_and_keeps_its_rows() -> None:
    rows = BlockTableRows(width=2, capacity=2, device=torch.device("cpu"))  # 1 usable row
    seqs = [_Seq([10 + i, 20 + i]) for i in range(3)]
    for s in seqs:
        updates: list[int] = []
        rows.row(s, s.block_table, updates)
        _apply(rows, updates)
    # The second sequence doubled the table (graphs on the old one must be recaptured);
    # the first one's row, written before, was carried over.
    assert rows.generation == 1 and rows.table.shape == (4, 2)
    assert rows.table.tolist() == [[0, 0], [10, 20], [11, 21], [12, 22]]
    with pytest.raises(ValueError, match="width"):
        rows.row(_Seq([1, 2, 3]), [1, 2, 3], [])
