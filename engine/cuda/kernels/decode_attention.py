"""Split-KV paged decode attention: one query token per sequence, read from the pool in place.

Two kernels:

* ``_decode_split_kernel``, grid ``(B, KVH, num_splits)``: a program takes every query head
  of one KV head (GQA: the ``H / KVH`` heads are the rows of one ``tl.dot``) and one
  contiguous slice of the sequence's context, and writes that slice's normalised output
  and its log-sum-exp (base 2). The number of splits is a launch constant, not a function
  of the data, so a CUDA graph captured for a batch size replays for any context length.
* ``_decode_reduce_kernel``, grid ``(B, H)``: combines the splits, weighting each by
  ``exp2(lse - max lse)``. Empty splits carry ``lse = -inf`` and weigh nothing.

A row with ``ctx_len == 0`` (a CUDA-graph padding row) has only empty splits: its output
is zeros, never NaN.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.cuda.kernels import dot_precision, next_power_of_2

MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256  # below this a split costs more in the reduce than it saves


def num_kv_splits(batch: int, kv_heads: int, max_ctx: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU twice over, but no
    split shorter than ``MIN_TOKENS_PER_SPLIT`` tokens and never more than ``MAX_SPLITS``."""
    want = -(-2 * num_sms // max(1, batch * kv_heads))
    by_len = -(-max_ctx // MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, want, by_len))


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # (B, H, D)
    pool_ptr,  # (NB, L, 2, bs, KVH, D)
    tables_ptr,  # (R, W) int32
    rows_ptr,  # (B,) int32: each sequence's row of the table
    ctx_ptr,  # (B,) int32: context length, the new token included
    part_out_ptr,  # (B, H, NUM_SPLITS, D) float32
    part_lse_ptr,  # (B, H, NUM_SPLITS) float32
    layer,
    scale_log2,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_pb,
    stride_pl,
    stride_pkv,
    stride_ps,
    stride_ph,
    stride_tr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per pool block
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP, >= 16 (tl.dot minimum)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    # Splits are whole BLOCK_N tiles, so every tile but a context's last is full.
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    hd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hd_mask)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    head_base = layer * stride_pl + kvh * stride_ph
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        blk = tl.load(tables_ptr + row * stride_tr + n // PAGE, mask=n_mask, other=0)
        off = blk.to(tl.int64) * stride_pb + head_base + (n % PAGE) * stride_ps  # (BLOCK_N,)
        kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(pool_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + off[:, None] + stride_pkv + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_H, BLOCK_N)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile has a key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    nonempty = end > start
    out = acc / tl.where(nonempty, den, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, den, 1.0)), float("-inf"))
    part = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # (BLOCK_H,)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=hd_mask)
    tl.store(part_lse_ptr + part, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,  # (B, H, NUM_SPLITS, D) float32
    part_lse_ptr,  # (B, H, NUM_SPLITS) float32
    out_ptr,  # (B, H, D), the query's dtype
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + part * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all empty: every weight is 0 below
    w = tl.exp2(lse - top)  # (BLOCK_S,)
    mask = (s[:, None] < NUM_SPLITS) & (d[None, :] < HEAD_DIM)
    parts = tl.load(
        part_out_ptr + (part * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
        mask=mask,
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    num_splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, D) attends to each sequence's first ``ctx_lens[b]`` pooled tokens of
    ``layer`` -> (B, H, D) in q's dtype (into ``out`` when given).

    ``block_tables`` (R, W) int32 and ``seq_rows`` (B,) int32: sequence b's blocks are
    ``block_tables[seq_rows[b]]``. Launches only: no host sync, safe to graph-capture.
    """
    b, heads, d = q.shape
    kv_heads, page = pool.shape[4], pool.shape[3]
    assert heads % kv_heads == 0 and pool.shape[5] == d and pool.stride(5) == 1
    assert q.stride(2) == 1 and block_tables.stride(1) == 1
    group = heads // kv_heads
    part_out = torch.empty(b, heads, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous
    block_d = max(16, next_power_of_2(d))
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q,
        pool,
        block_tables,
        seq_rows,
        ctx_lens,
        part_out,
        part_lse,
        layer,
        math.log2(math.e) / math.sqrt(d),
        q.stride(0),
        q.stride(1),
        *pool.stride()[:5],  # axis 5 (head_dim) is contiguous
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=d,
        PAGE=page,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=64,  # a tile may span pages: each key looks its block up
        PRECISION=dot_precision(q.dtype),
    )
    _decode_reduce_kernel[(b, heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out
