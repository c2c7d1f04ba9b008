"""Attention over the paged KV pool, for a flat batch of tokens from many sequences.

The batch is ``T`` tokens: sequence ``i`` contributes ``q_lens[i]`` consecutive tokens at
positions ``[ctx_lens[i] - q_lens[i], ctx_lens[i])``. Each layer first writes the new K/V
into the pool (slots from the block tables), then attends:

* a decode batch (every ``q_len == 1``) gathers all sequences' blocks at once into a
  padded (B, S) context and runs one masked SDPA call;
* a prefill batch runs one causal SDPA call per sequence; a sequence with earlier
  chunks already in the pool reads its whole context back from the pool.

SDPA is PyTorch's fused kernel on every device (flash / memory-efficient on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a flat token batch reads and writes KV. Shapes: B sequences, T tokens."""

    slot_blocks: torch.Tensor  # (T,) int64 block id each token's KV is written to
    slot_offsets: torch.Tensor  # (T,) int64 slot within that block
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with block 0
    ctx_lens: list[int]  # (B,) KV length after this step, new tokens included
    q_lens: list[int]  # (B,) new tokens per sequence; sum == T
    is_decode: bool
    context_mask: torch.Tensor | None = None  # (B, 1, 1, S) bool, decode only


def write_kv(
    pool: torch.Tensor, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v: (T, kv_heads, head_dim) into pool[block, layer, 0|1, slot]."""
    pool[meta.slot_blocks, layer, 0, meta.slot_offsets] = k
    pool[meta.slot_blocks, layer, 1, meta.slot_offsets] = v


def paged_attention(
    pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """q: (T, heads, D); k, v: (T, kv_heads, D) of the new tokens -> (T, heads, D)."""
    write_kv(pool, layer, meta, k, v)
    if meta.is_decode:
        return _decode_attention(pool, layer, meta, q)
    outputs = []
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(meta.q_lens, meta.ctx_lens)):
        qi = q[start : start + q_len]
        if q_len == ctx_len:
            # No earlier chunk: the fresh K/V are the whole context.
            ki, vi = k[start : start + q_len], v[start : start + q_len]
        else:
            ki, vi = _gather_context(pool, layer, meta.block_tables[i], ctx_len)
        outputs.append(_causal_sdpa(qi, ki, vi))
        start += q_len
    return torch.cat(outputs, dim=0)


def _gather_context(
    pool: torch.Tensor, layer: int, block_table: torch.Tensor, ctx_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n_blocks = -(-ctx_len // pool.shape[3])
    kv = pool[block_table[:n_blocks], layer]  # (n, 2, block_size, kv_heads, D)
    kv = kv.transpose(0, 1).flatten(1, 2)[:, :ctx_len]  # (2, ctx_len, kv_heads, D)
    return kv[0], kv[1]


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (n, H, D) are the last n positions of a context k, v: (c, KVH, D)."""
    n, c = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, len, D)
    if n == c:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        # Query j sits at position c - n + j and sees keys 0..c - n + j.
        mask = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(diagonal=c - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


def _decode_attention(
    pool: torch.Tensor, layer: int, meta: AttentionMetadata, q: torch.Tensor
) -> torch.Tensor:
    b = q.shape[0]
    kv = pool[meta.block_tables, layer]  # (B, max_blocks, 2, block_size, KVH, D)
    kv = kv.transpose(1, 2).flatten(2, 3)  # (B, 2, S, KVH, D)
    keys = kv[:, 0].transpose(1, 2)  # (B, KVH, S, D)
    values = kv[:, 1].transpose(1, 2)
    qh = q.view(b, 1, q.shape[1], q.shape[2]).transpose(1, 2)  # (B, H, 1, D)
    out = F.scaled_dot_product_attention(
        qh, keys, values, attn_mask=meta.context_mask, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(b, q.shape[1], q.shape[2])
