"""LoRA adapters on a linear layer, several in one batch: the weights room's part.

A ``Linear`` that adapters may touch holds a ``LoraBank``: per resident slot (at most
``--max-loras``), the adapter's low-rank pair for this layer, or nothing. Which rows of
a step belong to which slot is set once per step by the runner (``lora_rows``, a context
variable, as ``decode_rows`` is), so the model code never branches on adapters. Under
it each projection computes

    y = base(x)                                    (every row, packed or dense, as ever)
    y[rows of s] += (x[rows of s] @ A_s^T) @ B_s^T  for each slot s present in the step

grouped by adapter: one pair of small GEMMs per adapter in the step, whatever its rows.
A row's update depends on its own adapter and input only, so each row gets what it gets
alone (the index_select'ed rows run the same GEMMs as alone, at a different row count).

Fused layers (``qkv``, ``gate_up``) hold one pair per slot for all their parts: A is the
parts' A matrices stacked (sum r, K) and B block-diagonal (N, sum r), each part's B in
its own output rows with the part's scaling folded in; a part the adapter does not
target has no rows in A and zero rows in B.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows by adapter slot: ``(slot, rows)`` with rows (n,) int64 indices into
    the step's T rows, or None when the slot has every row. Rows of no group are base."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]


_ROWS: contextvars.ContextVar[LoraBatch | None] = contextvars.ContextVar("lora_rows", default=None)


@contextmanager
def lora_rows(batch: LoraBatch | None) -> Iterator[None]:
    """Apply ``batch``'s adapters to every ``LoraBank`` called inside."""
    token = _ROWS.set(batch)
    try:
        yield
    finally:
        _ROWS.reset(token)


def group_rows(row_slots: list[int], device: torch.device) -> LoraBatch | None:
    """``row_slots``: each row's slot, -1 for the base -> the step's ``LoraBatch`` (None
    when every row is base)."""
    slots = sorted({s for s in row_slots if s >= 0})
    if not slots:
        return None
    if len(slots) == 1 and all(s == slots[0] for s in row_slots):
        return LoraBatch(((slots[0], None),))
    groups = []
    for s in slots:
        rows = [i for i, r in enumerate(row_slots) if r == s]
        groups.append((s, torch.tensor(rows, dtype=torch.long, device=device)))
    return LoraBatch(tuple(groups))


class LoraBank:
    """One linear layer's adapter pairs by slot, held transposed for ``x @ A^T @ B^T``
    without a view per call: A^T (K, r) and B^T (r, N), scaling in B."""

    def __init__(self, num_slots: int) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1], (a.shape, b.shape)
        self.pairs[slot] = (a.T.contiguous(), b.T.contiguous())

    def clear(self, slot: int) -> None:
        self.pairs[slot] = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (T, K), the base output y (T, N) -> y with the step's updates added."""
        batch = _ROWS.get()
        if batch is None:
            return y
        for slot, rows in batch.groups:
            pair = self.pairs[slot]
            if pair is None:  # this adapter does not touch this layer
                continue
            at, bt = pair
            # NOTE: in place: ``y`` is the base kernel's fresh output, held by no one else.
            if rows is None:
                y.add_(torch.mm(torch.mm(x.to(at.dtype), at), bt))  # (T, r) -> (T, N)
            else:
                xs = x.index_select(0, rows).to(at.dtype)  # (n, K)
                y.index_add_(0, rows, torch.mm(torch.mm(xs, at), bt).to(y.dtype))
        return y
