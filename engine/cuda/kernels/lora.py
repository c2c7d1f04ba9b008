"""Batched LoRA updates on the CUDA path: ``y[rows of s] += (x[rows of s] @ A_s^T) @ B_s^T``
for every adapter slot s of a step, in two launches whatever the adapters.

The adapters' weights sit stacked by slot (``engine/cuda/lora_bank.py``): A (S, R, K) and
B (S, N, R), R the bank's rank width (a fused layer's parts side by side), unused ranks
zero, scaling folded into B. Which rows belong to which slot comes as tiles
(``engine/cuda/lora_tiles.py``): a tile is at most ``TILE_ROWS`` rows of ONE adapter,
named through ``order``; base rows are in no tile and are never touched.

* shrink: one program per tile, v (T, R) = x[rows] @ A[slot]^T over K in blocks;
* expand: one program per (tile, block of N columns), y[rows] += v[rows] @ B[slot]^T,
  in place in the base projection's output (a row is in one tile: no two programs write
  the same element).

Rounding follows the torch path (``engine/weights/lora.py``: two ``torch.mm`` and an
add in the model dtype): v is rounded to the weights' dtype before the expand, the
product to y's dtype before the add. Empty tiles (slot -1, the padding of a graph's fixed
grid) return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.cuda.kernels import dot_precision, next_power_of_2
from engine.cuda.lora_tiles import TILE_ROWS


@triton.jit
def _tile_rows(tiles_ptr, order_ptr, tile, num_tiles, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
    """Tile ``tile``'s slot (-1: an empty tile), its rows' indices into x and y
    (BLOCK_M,) int64, and which of them are real."""
    slot = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + num_tiles + tile)
    end = tl.load(tiles_ptr + 2 * num_tiles + tile)
    i = first + tl.arange(0, BLOCK_M)
    m_row = i < end
    rows = tl.load(order_ptr + i, mask=m_row, other=0).to(tl.int64)
    return slot, rows, m_row


@triton.jit
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # (T, K)
    a_ptr,  # (S, R, K)
    v_ptr,  # (T, R) float32: written for the rows of tiles only
    order_ptr,  # (T,) int32
    tiles_ptr,  # (3, M) int32: slot, first, past-the-end (into order)
    num_tiles,
    stride_x,
    stride_v,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, rows, m_row = _tile_rows(tiles_ptr, order_ptr, tl.program_id(0), num_tiles, BLOCK_M)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    m_r = r < R
    a_base = a_ptr + slot.to(tl.int64) * (R * K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        m_k = k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :],
            mask=m_row[:, None] & m_k[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        a_t = tl.load(
            a_base + r[None, :] * K + k[:, None], mask=m_k[:, None] & m_r[None, :], other=0.0
        )  # (BLOCK_K, BLOCK_R): A^T's block
        acc += tl.dot(x.to(a_t.dtype), a_t, input_precision=PRECISION)
    tl.store(v_ptr + rows[:, None] * stride_v + r[None, :], acc, mask=m_row[:, None] & m_r[None, :])


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    v_ptr,  # (T, R) float32
    b_ptr,  # (S, N, R)
    y_ptr,  # (T, N): the base output, updated in place
    order_ptr,  # (T,) int32
    tiles_ptr,  # (3, M) int32
    num_tiles,
    stride_v,
    stride_y,
    N: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, rows, m_row = _tile_rows(tiles_ptr, order_ptr, tl.program_id(0), num_tiles, BLOCK_M)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    m_r = r < R
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = n < N
    b_t = tl.load(
        b_ptr + slot.to(tl.int64) * (N * R) + n[None, :] * R + r[:, None],
        mask=m_r[:, None] & m_n[None, :],
        other=0.0,
    )  # (BLOCK_R, BLOCK_N): B^T's block
    v = tl.load(
        v_ptr + rows[:, None] * stride_v + r[None, :], mask=m_row[:, None] & m_r[None, :], other=0.0
    )
    # NOTE: v rounded to the weights' dtype, as the torch path's first mm returns it.
    upd = tl.dot(v.to(b_t.dtype), b_t, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
    at = y_ptr + rows[:, None] * stride_y + n[None, :]
    mask = m_row[:, None] & m_n[None, :]
    y = tl.load(at, mask=mask, other=0.0)
    out = y.to(tl.float32) + upd.to(y.dtype).to(tl.float32)
    tl.store(at, out.to(y.dtype), mask=mask)


def lora_update(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    tiles: torch.Tensor,
) -> torch.Tensor:
    """x (T, K), the base output y (T, N), the stacked A (S, R, K) and B (S, N, R), the
    step's ``order`` (T,) and ``tiles`` (3, M) -> y, each tile's rows updated in place.

    Launch shapes depend on (K, N, R, M) only: a decode graph's fixed grid replays it.
    """
    t, k = x.shape
    s, r, k_a = a.shape
    n = y.shape[1]
    assert k_a == k and b.shape == (s, n, r) and y.shape[0] == t, (x.shape, a.shape, b.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert tiles.shape[0] == 3 and tiles.is_contiguous() and order.shape[0] >= t
    m = tiles.shape[1]
    v = torch.empty(t, r, dtype=torch.float32, device=x.device)
    precision = dot_precision(a.dtype)
    block_r = max(16, next_power_of_2(r))  # tl.dot needs 16 at least
    _shrink_kernel[(m,)](
        x,
        a,
        v,
        order,
        tiles,
        m,
        x.stride(0),
        v.stride(0),
        K=k,
        R=r,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=block_r,
        BLOCK_K=min(64, max(16, next_power_of_2(k))),
        PRECISION=precision,
    )
    block_n = min(128, max(16, next_power_of_2(n)))
    _expand_kernel[(m, -(-n // block_n))](
        v,
        b,
        y,
        order,
        tiles,
        m,
        v.stride(0),
        y.stride(0),
        N=n,
        R=r,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        PRECISION=precision,
    )
    return y
