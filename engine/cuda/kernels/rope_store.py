"""Rotary embedding on q and k fused with the KV store: one pass over the new tokens.

Per token (one program each): q's heads are rotated in place; k's heads are rotated and
written, with v, straight into the token's pool slot. Rotated k is never written back to
the activations: attention reads K from the pool only.

Rotation is the "rotate half" form of ``engine/model/rope.py``: with c, s the cos/sin of the
first half of the head, ``x1' = x1 c - x2 s`` and ``x2' = x2 c + x1 s``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.cuda.kernels import next_power_of_2


@triton.jit
def _rope_store_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # (T, H, D), rotated in place
    k_ptr,  # (T, KVH, D)
    v_ptr,  # (T, KVH, D)
    cos_ptr,  # (P, D): cos of each position; the two halves are equal
    sin_ptr,  # (P, D)
    pos_ptr,  # (T,) int32
    slot_ptr,  # (T,) int32: block * PAGE + offset in the block; < 0: do not store
    pool_ptr,  # (NB, L, 2, PAGE, KVH, D)
    layer,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_pb,
    stride_pl,
    stride_pkv,
    stride_ps,
    stride_ph,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j[None, :] < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]

    # NOTE: rotations are written out, not a @triton.jit helper: the interpreter (tests)
    # pays for every nested call.
    q_off = t * stride_qt + h[:, None] * stride_qh + j[None, :]
    q_mask = (h[:, None] < HEADS) & j_mask
    x1 = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_ptr + q_off + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + q_off, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptr + q_off + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        kv_mask = (h[:, None] < KV_HEADS) & j_mask
        k_off = t * stride_kt + h[:, None] * stride_kh + j[None, :]
        x1 = tl.load(k_ptr + k_off, mask=kv_mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_ptr + k_off + HALF, mask=kv_mask, other=0.0).to(tl.float32)
        v_off = t * stride_vt + h[:, None] * stride_vh + j[None, :]
        v1 = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptr + v_off + HALF, mask=kv_mask, other=0.0)
        blk = (slot // PAGE).to(tl.int64)
        dst = blk * stride_pb + layer * stride_pl + (slot % PAGE) * stride_ps
        dst = dst + h[:, None] * stride_ph + j[None, :]
        out_ty = pool_ptr.dtype.element_ty
        tl.store(pool_ptr + dst, (x1 * cos - x2 * sin).to(out_ty), mask=kv_mask)
        tl.store(pool_ptr + dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=kv_mask)
        tl.store(pool_ptr + dst + stride_pkv, v1.to(out_ty), mask=kv_mask)
        tl.store(pool_ptr + dst + stride_pkv + HALF, v2.to(out_ty), mask=kv_mask)


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
) -> None:
    """Rotate q (T, H, D) in place; write rotated k and v (T, KVH, D) to ``layer``'s slots.

    ``cos``/``sin``: (P, D) tables (engine/model/rope.py); ``positions``, ``slots``: (T,) int32;
    a negative slot (a padding row) stores nothing. q, k, v may be strided views (the
    columns of one qkv projection) as long as each head's D values are contiguous.
    """
    t, heads, d = q.shape
    kv_heads, page = pool.shape[4], pool.shape[3]
    assert d % 2 == 0 and k.shape == v.shape == (t, kv_heads, d) and pool.shape[5] == d
    assert q.stride(2) == k.stride(2) == v.stride(2) == cos.stride(1) == pool.stride(5) == 1
    assert cos.stride() == sin.stride()
    _rope_store_kernel[(t,)](
        q,
        k,
        v,
        cos,
        sin,
        positions,
        slots,
        pool,
        layer,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        *pool.stride()[:5],  # axis 5 (head_dim) is contiguous
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=d // 2,
        PAGE=page,
        BLOCK_H=next_power_of_2(max(heads, kv_heads)),
        BLOCK_HALF=next_power_of_2(d // 2),
    )
