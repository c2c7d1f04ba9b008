"""The LM head on a packed kernel, its leading logits recomputed exactly in float32
(``RefinedHead``); ``engine/weights/linear.py``'s ``Linear`` holds it like any kernel."""

from __future__ import annotations

import torch
from torch import nn

from engine.direct_attrs import DirectAttrs
from engine.kernels.cpu import ops
from engine.weights import int4_tiles
from engine.weights.quant import Int8Rows, QuantRows


class RefinedHead(DirectAttrs):
    """An LM head on a packed kernel whose leading logits are recomputed in float32.

    The packed kernel returns bfloat16 logits: near 25, one step of bfloat16 is 0.125,
    more than the margin between SmolLM2's two best first tokens on a plain question, so
    greedy decoding would follow rounding, not the model. Every logit within
    ``_MARGIN_STEPS`` bfloat16 steps of its row's maximum (at most ``_MAX_REFINED``) is
    recomputed exactly: float32 activations times the exact de-quantized rows. The rest
    keep their bfloat16 values, which only sampling at a temperature sees.

    On CPU, where pdserve's kernels run (``int4_tiles.kernel_name()`` is not ``torch``) and
    the head is int8, one op does it (``refine_near_logits``, ``near_logits.cpp``): the
    torch ops below cost ~0.36 ms of a ~4 ms one-row decode step on two cores, the op a
    few hundredths of that. Both pick the same logits and compute each as a float32 sum
    over the row; their sums run in different orders (bits may differ in the last place).
    """

    _MARGIN_STEPS = 4
    _MAX_REFINED = 64

    compute_dtype = torch.float32

    def __init__(self, packed: nn.Module, rows: QuantRows) -> None:
        super().__init__()
        self.packed, self.rows = packed, rows
        on_cpu_kernels = rows.codes.device.type == "cpu" and int4_tiles.kernel_name() != "torch"
        self.refine_op = (
            ops.refine_near_logits_op() if isinstance(rows, Int8Rows) and on_cpu_kernels else None
        )
        # Near logits as products summed per logit (``engine/model/batch_invariance.py``): the
        # batched product's sums run in an order that moves with the batch's shape.
        self.row_invariant = False

    def native(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x, None)

    def input_dtype_for(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype  # the refined logits read x as it is

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x (T, K) -> float32 logits (T, vocab), whatever ``out_dtype``."""
        out = self.packed.forward(x, bias, torch.float32)  # (T, vocab)
        if x.dtype != torch.float32:
            return out
        if self.refine_op is not None:  # int8 rows on CPU (__init__)
            codes, scale = self.rows.codes, self.rows.scale
            margin, most = self._MARGIN_STEPS, self._MAX_REFINED
            return self.refine_op(out, x.contiguous(), codes, scale, bias, margin, most)
        # Every near logit by a threshold on each row's maximum: a max, a compare and a
        # nonzero over the vocabulary cost ~0.1 ms a decode step where a top-k took ~0.2 ms
        # alone. The same set as ``_refine_top``'s wherever no row has more than
        # ``_MAX_REFINED`` near logits (then that path runs).
        top = out.amax(dim=1, keepdim=True)  # (T, 1)
        rows, cols = (out >= top - self._MARGIN_STEPS * _bf16_step(top)).nonzero(as_tuple=True)
        if rows.numel() > self._MAX_REFINED and (
            out.shape[0] == 1 or int(torch.bincount(rows).max()) > self._MAX_REFINED
        ):
            return self._refine_top(out, x, bias)
        w = self.rows.rows(cols).dequantize()  # (P, K): one row of the head per near logit
        exact = (x[rows] * w).sum(dim=1)  # (P,): a sum over K per logit, whatever the batch
        if bias is not None:
            exact += bias[cols]
        return out.index_put_((rows, cols), exact)

    def _refine_top(
        self, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The near logits among each row's ``_MAX_REFINED`` largest, recomputed."""
        k = min(self._MAX_REFINED, out.shape[1])
        top, idx = out.topk(k, dim=1)  # (T, k)
        near = top >= top[:, :1] - self._MARGIN_STEPS * _bf16_step(top[:, :1])  # a prefix
        n = int(near.sum(dim=1).max())
        idx = idx[:, :n]
        w = self.rows.rows(idx.flatten()).dequantize().view(*idx.shape, -1)  # (T, n, K)
        if self.row_invariant:
            exact = (x.unsqueeze(1) * w).sum(dim=2)  # (T, n): a sum over K per logit
        else:
            exact = torch.einsum("tk,tnk->tn", x, w)
        if bias is not None:
            exact += bias[idx]
        # Only a row's own near logits: ``n`` is the batch's widest, and a row's logits
        # must not depend on the rows beside it (a speculative verification's rows get
        # the bits their decode steps would, one row each).
        exact = torch.where(near[:, :n], exact, top[:, :n])
        return out.scatter_(1, idx, exact)


def _bf16_step(v: torch.Tensor) -> torch.Tensor:
    """One bfloat16 step at ``v``: 2^(e - 7) for |v| = 1.m x 2^e (from the float's exponent:
    a rounded log2 would take a maximum just under a power of two for that power)."""
    exponent = torch.frexp(v.abs().clamp_min(1e-30)).exponent  # |v| = f x 2^exponent, f in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), exponent - 8)
