"""The CUDA path's adapter bank: every slot's pair of one linear layer in ONE preallocated
buffer each, so loading an adapter writes into a slot and no tensor address ever changes
(a captured decode graph keeps reading the right weights).

    a (S, R, K)   slot s's A in rows [0, r_s), zero beyond
    b (S, N, R)   slot s's B (scaling folded in) in columns [0, r_s), zero beyond

R is the layer's rank width: ``--max-lora-rank`` times its parts (3 for qkv, 2 for
gate_up). A slot the adapter leaves alone for this layer is all zero: its rows get a zero
update (exactly y), at the cost of a few small dots. The memory is held from startup,
counted before the KV pool is sized, and never grows with loads.

A step's rows come as ``LoraTiles`` on the kernel path (Triton, ``kernels/lora.py``) or
as a ``LoraBatch`` when a kernel runner takes the torch forward (scoring every position,
speculative verification): both read the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cuda.kernels.lora import lora_update
from engine.weights.lora import AdapterBank, LoraBatch, LoraTiles, current_rows


class StackedLoraBank(AdapterBank):
    def __init__(
        self,
        num_slots: int,
        in_features: int,
        out_features: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)
        self._held = [0] * num_slots  # rank width each slot uses (0: none)

    @staticmethod
    def factory(
        num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> Callable[[int, int, int], AdapterBank]:
        """(in_features, out_features, width) -> a bank: what ``LoraAdapters`` builds."""
        return lambda k, n, width: StackedLoraBank(num_slots, k, n, width, dtype, device)

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        r = a.shape[0]
        assert r <= self.a.shape[1] and a.shape[1] == self.a.shape[2], (a.shape, self.a.shape)
        assert b.shape == (self.b.shape[1], r), (b.shape, self.b.shape)
        self.clear(slot)
        self.a[slot, :r].copy_(a)
        self.b[slot, :, :r].copy_(b)
        self._held[slot] = r

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self._held[slot] = 0

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes  # preallocated: the same loaded or not

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows = current_rows()
        if rows is None:
            return y
        if isinstance(rows, LoraTiles):
            return lora_update(x, y, self.a, self.b, rows.order, rows.tiles)
        return self._torch(x, y, rows)

    def _torch(self, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """The torch path's math on the stacked buffers (a kernel runner's torch forward)."""
        for slot, rows in batch.groups:
            r = self._held[slot]
            if r == 0:
                continue
            at, bt = self.a[slot, :r].T, self.b[slot, :, :r].T  # (K, r), (r, N)
            if rows is None:
                y.add_(torch.mm(torch.mm(x.to(at.dtype), at), bt))
            else:
                xs = x.index_select(0, rows).to(at.dtype)
                y.index_add_(0, rows, torch.mm(torch.mm(xs, at), bt).to(y.dtype))
        return y
