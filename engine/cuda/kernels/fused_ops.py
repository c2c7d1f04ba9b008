"""Fused row-wise ops of the decoder around attention: (add +) RMSNorm and SiLU * up.

Each matches its torch counterpart in ``engine/model/layers.py`` rounding step for rounding step
where it matters: the residual sum is rounded to the model dtype before it is normalised
(as ``x + sublayer(x)`` is), the norm is computed in float32 and rounded before the weight
multiplies it, and silu(gate) is rounded before it multiplies ``up``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.cuda.kernels import next_power_of_2


@triton.jit
def _rmsnorm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # (T, N)
    res_ptr,  # (T, N): the residual stream, updated in place to x + res (HAS_RESIDUAL)
    w_ptr,  # (N,)
    out_ptr,  # (T, N)
    stride_x,
    stride_r,
    stride_o,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < N
    x = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + c, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + t * stride_r + c, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * inv).to(x.dtype)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    out = w * normed.to(tl.float32)  # NOTE: explicit float32 math (as torch does for bf16)
    tl.store(out_ptr + t * stride_o + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x (T, N) -> weight * rmsnorm(x), or, with ``residual`` (T, N): first
    ``residual += x`` in place (the decoder's skip connection), then the norm of the sum."""
    t, n = x.shape
    assert x.stride(1) == 1 and weight.shape == (n,)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    res = x if residual is None else residual
    assert res.shape == x.shape and res.stride(1) == 1
    _rmsnorm_kernel[(t,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        N=n,
        BLOCK=next_power_of_2(n),
        HAS_RESIDUAL=residual is not None,
    )
    return out


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # (T, 2 * N): gate columns then up columns
    out_ptr,  # (T, N)
    stride_x,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    gate = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + N + c, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 * tl.sigmoid(g32)).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_o + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 * N) output of the fused gate/up GEMM -> silu(gate) * up, (T, N)."""
    t, two_n = gate_up.shape
    assert two_n % 2 == 0 and gate_up.stride(1) == 1
    n = two_n // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(n))
    _silu_mul_kernel[(t, -(-n // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block
    )
    return out
