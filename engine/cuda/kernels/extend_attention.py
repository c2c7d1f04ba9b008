"""Paged prefill / extend attention: a chunk's queries attend to every earlier token of
their sequence (cached blocks from earlier chunks and, causally, the chunk itself).

The chunk's own K/V are written into the pool first (``rope_store``), so the kernel reads
one source only: the pool, through the sequence's block-table row. A fresh prompt is the
special case of no cached context.

Grid ``(B, KVH, query tiles)``. A program takes ``TOKENS`` consecutive query tokens of one
sequence times the ``GROUP`` query heads of one KV head, as the ``ROWS`` rows of one
``tl.dot`` (row r: token r // GROUP, head r % GROUP), so each K/V tile is loaded once for
all heads that read it. Query token j of a chunk of ``q_len`` in a context of ``ctx`` sits
at position ``ctx - q_len + j`` and sees keys ``0 ..= ctx - q_len + j``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.cuda.kernels import dot_precision, next_power_of_2


@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # (T, H, D): the batch's new tokens, sequence after sequence
    pool_ptr,  # (NB, L, 2, bs, KVH, D), this step's K/V already written
    tables_ptr,  # (R, W) int32
    rows_ptr,  # (B,) int32
    ctx_ptr,  # (B,) int32: context length after this chunk
    q_start_ptr,  # (B + 1,) int32: sequence b's tokens are [q_start[b], q_start[b + 1])
    out_ptr,  # (T, H, D)
    layer,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_pb,
    stride_pl,
    stride_pkv,
    stride_ps,
    stride_ph,
    stride_tr,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,  # query tokens per program: ROWS // GROUP
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b)
    q_len = tl.load(q_start_ptr + b + 1) - q_start
    if tile * TOKENS >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)

    r = tl.arange(0, ROWS)
    token = tile * TOKENS + r // GROUP
    valid = (r < TOKENS * GROUP) & (token < q_len)
    token = tl.minimum(token, q_len - 1)  # padding rows compute a real row, never stored
    head = kvh * GROUP + r % GROUP
    q_pos = ctx - q_len + token  # (ROWS,)
    d = tl.arange(0, BLOCK_D)
    d_mask = d[None, :] < HEAD_DIM
    q_off = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=valid[:, None] & d_mask, other=0.0)

    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    head_base = layer * stride_pl + kvh * stride_ph
    kv_end = tl.minimum(ctx, ctx - q_len + tile * TOKENS + TOKENS)  # past the tile's last query
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        blk = tl.load(tables_ptr + row * stride_tr + n // PAGE, mask=n_mask, other=0)
        off = blk.to(tl.int64) * stride_pb + head_base + (n % PAGE) * stride_ps
        kv_mask = n_mask[:, None] & d_mask
        k = tl.load(pool_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + off[:, None] + stride_pkv + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (ROWS, BLOCK_N)
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        # NOTE: key 0 is in the first tile and every row sees it, so m is finite from the
        # first iteration on; a later tile wholly in a row's future adds p = 0.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out = acc / den[:, None]
    o_off = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_off[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & d_mask,
    )


def extend_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_q_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (T, H, D) -> (T, H, D): causal attention of each chunk over its whole context.

    ``q_starts`` (B + 1,) int32 cumulative chunk lengths; ``ctx_lens`` (B,) int32 context
    lengths including the chunk; ``max_q_len`` (host int) sizes the grid.
    """
    _, heads, d = q.shape
    kv_heads, page = pool.shape[4], pool.shape[3]
    assert heads % kv_heads == 0 and pool.shape[5] == d and pool.stride(5) == 1
    assert q.stride(2) == 1 and block_tables.stride(1) == 1
    group = heads // kv_heads
    rows = max(64, next_power_of_2(group))
    tokens = rows // group
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous
    b = seq_rows.shape[0]
    _extend_kernel[(b, kv_heads, -(-max_q_len // tokens))](
        q,
        pool,
        block_tables,
        seq_rows,
        ctx_lens,
        q_starts,
        out,
        layer,
        math.log2(math.e) / math.sqrt(d),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *pool.stride()[:5],  # axis 5 (head_dim) is contiguous
        block_tables.stride(0),
        GROUP=group,
        TOKENS=tokens,
        HEAD_DIM=d,
        PAGE=page,
        ROWS=rows,
        BLOCK_D=max(16, next_power_of_2(d)),
        BLOCK_N=64,
        PRECISION=dot_precision(q.dtype),
    )
    return out
