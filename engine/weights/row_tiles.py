"""A dense GEMM whose rows' bits do not depend on how many rows share the call.

The CPU BLAS picks its kernel and reduction order by a call's shape (one row takes a
GEMV, whose sums run in another order than a GEMM's; larger calls change blocking), so a
row's product can differ in its last bits with the rows beside it. Batch-invariant
serving (``engine/model/batch_invariance.py``) runs dense layers in calls of one fixed shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per call: enough for a GEMM's register blocking, few enough that a decode step of
# a handful of rows pads little.
ROW_TILE = 16


def tiled_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: int = ROW_TILE
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` in calls of exactly ``tile`` rows: x (T, K), w (N, K) ->
    (T, N), the last call's rows padded with zeros.

    NOTE: every row meets the same product, (tile, K) x (K, N), whatever T and wherever
    the row sits in its tile; the bias is added after, element by element.
    """
    t = x.shape[0]
    pad = -t % tile
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x  # (T + pad, K)
    out = torch.empty(t + pad, w.shape[0], dtype=x.dtype, device=x.device)
    wt = w.t()
    for lo in range(0, t + pad, tile):
        torch.mm(xp[lo : lo + tile], wt, out=out[lo : lo + tile])
    out = out[:t]
    return out if bias is None else out.add_(bias)
