"""Stateless building blocks of a Llama-family decoder: norm, MLP, weight helpers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.direct_attrs import DirectAttrs
from engine.weights.linear import Linear


def weight(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised inference parameter; the loader fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(DirectAttrs):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; equal to the lines below to ~1e-7
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 whatever the model dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(DirectAttrs):
    """down(silu(gate(x)) * up(x)); gate and up are one (2 * inter, hidden) linear."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up = Linear(hidden, 2 * inter, False, dtype, device)
        self.down = Linear(inter, hidden, False, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        silu_mul: Callable[[torch.Tensor, torch.dtype, torch.dtype | None], torch.Tensor],
        native: bool = False,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden) in x's dtype. ``silu_mul``: the backend's (T, 2 * inter)
        -> (T, inter), computed in the first dtype, rounded to the second; ``native``: it
        takes gate and up in the kernel's dtype (``Linear.native``) and may hand down its
        input in the dtype down rounds it to (``Linear.input_dtype_for``)."""
        if not native:
            return self.down(silu_mul(self.gate_up(x), x.dtype, None), x.dtype)
        gate_up = self.gate_up.native(x)
        return self.down(silu_mul(gate_up, x.dtype, self.down.input_dtype_for(gate_up)), x.dtype)
