"""LoRA adapters on a linear layer, several in one batch: the weights room's part.

A ``Linear`` that adapters may touch holds a ``LoraBank``: per resident slot (at most
``--max-loras``), the adapter's low-rank pair for this layer, or nothing. Which rows of
a step belong to which slot is set once per step by the runner (``lora_rows``, a context
variable, as ``decode_rows`` is), so the model code never branches on adapters. Under
it each projection computes

    y = base(x)                                    (every row, packed or dense, as ever)
    y[rows of s] += (x[rows of s] @ A_s^T) @ B_s^T  for each slot s present in the step

How depends on the step:

- one adapter on every row: its own pair, two GEMMs;
- decode-sized steps (at most ``GATHER_ROWS`` rows): every resident adapter's pair at
  once, as one shrink GEMM over A of all slots stacked (K, R), a mask that keeps each
  row's own adapter's columns, and one expand GEMM over B stacked (R, N): three ops per
  layer whatever the number of adapters, instead of four per adapter. The masked
  columns are exact zeros, so a row still gets only its own adapter's update;
- larger steps (prefill chunks): one pair of GEMMs per adapter over its rows, where the
  stacked shrink would multiply every row by every adapter's A.

Every path computes the same products for a row; they differ only in how float32 sums
them (over exact zeros, at another row count), as the base projection's GEMM may at
another batch size: a row gets what it gets alone up to that rounding.

Fused layers (``qkv``, ``gate_up``) hold one pair per slot for all their parts: A is the
parts' A matrices stacked (sum r, K) and B block-diagonal (N, sum r), each part's B in
its own output rows with the part's scaling folded in; a part the adapter does not
target has no rows in A and zero rows in B.

Two banks behind one face (``AdapterBank``): ``LoraBank`` here, the resident pairs
stacked (the torch path: memory held only while an adapter is), and the CUDA path's
stacked bank (``engine/cuda/lora_bank.py``: one preallocated (slots, ...) buffer per
layer, so graphs keep their addresses), which reads the step's rows as ``LoraTiles``.
"""

from __future__ import annotations

import abc
import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# Steps of at most this many rows apply every resident adapter at once (stacked, masked);
# larger ones loop over the adapters in the step. At 64 rows the stacked shrink over 8
# rank-16 adapters costs less than a tenth of the base projection it follows.
GATHER_ROWS = 64


@dataclass(frozen=True)
class LoraBatch:
    """A step's rows by adapter slot: ``(slot, rows)`` with rows (n,) int64 indices into
    the step's T rows, or None when the slot has every row. Rows of no group are base."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    row_slot: torch.Tensor  # (T,) int64: each row's slot, -1 for the base
    # Per column layout of a stacked bank (its ``col_slot`` key): the (T, R) 0/1 mask of
    # the columns each row keeps, built once per step and shared by every layer.
    masks: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)

    def mask(self, key: str, col_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        m = self.masks.get(key)
        if m is None:
            m = (self.row_slot[:, None] == col_slot[None, :]).to(dtype)
            self.masks[key] = m
        return m


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
    row_slot = torch.tensor(row_slots, dtype=torch.long, device=device)
    if len(slots) == 1 and all(s == slots[0] for s in row_slots):
        return LoraBatch(((slots[0], None),), row_slot)
    groups = []
    for s in slots:
        rows = [i for i, r in enumerate(row_slots) if r == s]
        groups.append((s, torch.tensor(rows, dtype=torch.long, device=device)))
    return LoraBatch(tuple(groups), row_slot)


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
    """One linear layer's adapter pairs, held transposed for ``x @ A^T @ B^T`` (scaling
    in B) and stacked, rebuilt when a slot is set or cleared: A^T of every resident slot
    side by side (K, R), B^T on top of each other (R, N), and ``col_slot`` (R,) naming
    the slot of each of the R shrink columns. ``pairs[s]`` is slot s's A^T (K, r) and
    B^T (r, N) as views into them (None: not resident, or not touching this layer)."""

    def __init__(self, num_slots: int) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        self._stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._key = ""

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1], (a.shape, b.shape)
        self.pairs[slot] = (a.T, b.T)
        self._stack()

    def clear(self, slot: int) -> None:
        self.pairs[slot] = None
        self._stack()

    def _stack(self) -> None:
        """Copy the held pairs into fresh stacked tensors and point ``pairs`` at their
        parts (views: the stacked copy is the only one kept)."""
        held = [(s, p) for s, p in enumerate(self.pairs) if p is not None]
        self._stacked, self._key = None, ""
        if not held:
            return
        at = torch.cat([p[0] for _, p in held], dim=1)
        bt = torch.cat([p[1] for _, p in held], dim=0)
        cols: list[int] = []
        for s, (a_t, _) in held:
            c0 = len(cols)
            cols += [s] * a_t.shape[1]
            self.pairs[s] = (at[:, c0 : len(cols)], bt[c0 : len(cols)])
        self._stacked = (at, bt, torch.tensor(cols, dtype=torch.long, device=at.device))
        # Banks with the same slots at the same ranks share a mask; a str caches its hash.
        self._key = ",".join(map(str, cols))

    @property
    def nbytes(self) -> int:
        return 0 if self._stacked is None else self._stacked[0].nbytes + self._stacked[1].nbytes

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = _ROWS.get()
        if batch is None or self._stacked is None:
            return y
        assert isinstance(batch, LoraBatch), "the kernel path's rows need a stacked bank"
        # NOTE: in place: ``y`` is the base kernel's fresh output, held by no one else.
        if len(batch.groups) == 1 and batch.groups[0][1] is None:  # one adapter, every row
            pair = self.pairs[batch.groups[0][0]]
            if pair is not None:
                y.add_(torch.mm(torch.mm(x.to(pair[0].dtype), pair[0]), pair[1]))
            return y
        if x.shape[0] <= GATHER_ROWS:
            at, bt, col_slot = self._stacked
            h = torch.mm(x.to(at.dtype), at)  # (T, R): every resident adapter's shrink
            h.mul_(batch.mask(self._key, col_slot, h.dtype))  # keep each row's own
            if y.dtype == bt.dtype:
                return y.addmm_(h, bt)
            return y.add_(torch.mm(h, bt))
        for slot, rows in batch.groups:
            pair = self.pairs[slot]
            if pair is None:  # this adapter does not touch this layer
                continue
            at, bt = pair
            assert rows is not None  # one group of every row is served above
            xs = x.index_select(0, rows).to(at.dtype)  # (n, K)
            y.index_add_(0, rows, torch.mm(torch.mm(xs, at), bt).to(y.dtype))
        return y
