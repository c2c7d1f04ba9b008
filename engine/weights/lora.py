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

Two banks behind one face (``AdapterBank``): ``LoraBank`` here, a tensor pair per
loaded slot (the torch path: memory held only while an adapter is), and the CUDA path's
stacked bank (``engine/cuda/lora_bank.py``: one preallocated (slots, ...) buffer per
layer, so graphs keep their addresses), which reads the step's rows as ``LoraTiles``.
"""

from __future__ import annotations

import abc
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


@dataclass(frozen=True)
class LoraTiles:
    """A step's rows by adapter slot on the kernel path, as device int32 tensors the
    Triton kernels read (``engine/cuda/lora_tiles.py`` plans them; fixed addresses, so a
    decode graph replays with new contents).

    ``order`` (T,): the step's rows, those of each adapter together; ``tiles`` (3, M): per
    tile of at most ``TILE_ROWS`` rows of one adapter, its slot (-1: an empty tile), and
    its first and past-the-end index into ``order``. Rows in no tile are base rows.
    """

    order: torch.Tensor
    tiles: torch.Tensor


_ROWS: contextvars.ContextVar[LoraBatch | LoraTiles | None] = contextvars.ContextVar(
    "lora_rows", default=None
)


def current_rows() -> LoraBatch | LoraTiles | None:
    """The rows ``lora_rows`` set for the forward running now (None: every row is base)."""
    return _ROWS.get()


@contextmanager
def lora_rows(batch: LoraBatch | LoraTiles | None) -> Iterator[None]:
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


class AdapterBank(abc.ABC):
    """One linear layer's adapters by slot: what ``Linear`` calls after its base kernel."""

    @abc.abstractmethod
    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Hold A (r, K) and B (N, r), scaling folded into B, in ``slot``."""

    @abc.abstractmethod
    def clear(self, slot: int) -> None:
        """``slot`` no longer holds this layer's pair (its memory freed, or zeroed)."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of adapter weights this bank holds now."""

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (T, K), the base output y (T, N) -> y with the step's updates added."""


class LoraBank(AdapterBank):
    """One linear layer's adapter pairs by slot, held transposed for ``x @ A^T @ B^T``
    without a view per call: A^T (K, r) and B^T (r, N), scaling in B."""

    def __init__(self, num_slots: int) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1], (a.shape, b.shape)
        self.pairs[slot] = (a.T.contiguous(), b.T.contiguous())

    def clear(self, slot: int) -> None:
        self.pairs[slot] = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pair in self.pairs if pair is not None for t in pair)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = _ROWS.get()
        if batch is None:
            return y
        assert isinstance(batch, LoraBatch), "the kernel path's rows need a stacked bank"
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
