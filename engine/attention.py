"""Attention over the paged KV pool, for a flat batch of tokens from many sequences.

The batch is ``T`` tokens: sequence ``i`` contributes ``q_lens[i]`` consecutive tokens at
positions ``[ctx_lens[i] - q_lens[i], ctx_lens[i])``. Each layer first writes the new K/V
into the pool (slots from the block tables), then attends:

* a decode batch (every ``q_len == 1``) gathers all sequences' blocks at once into a
  padded (B, S) context; on CUDA one masked SDPA call attends, on CPU two grouped
  matmuls do (each KV head serves its query group without repeating K/V, several
  times faster than CPU SDPA with a mask at one query per sequence);
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
    # NOTE: 4-D inputs: CPU SDPA takes its fused kernel only with a batch dimension.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, heads, len, D)
    if n == c:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        # Query j sits at position c - n + j and sees keys 0..c - n + j.
        mask = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(diagonal=c - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _decode_attention(
    pool: torch.Tensor, layer: int, meta: AttentionMetadata, q: torch.Tensor
) -> torch.Tensor:
    b, heads, d = q.shape
    num_layers, block_size, kv_heads = pool.shape[1], pool.shape[3], pool.shape[4]
    n_blocks = meta.block_tables.shape[1]
    # (block, layer) rows are contiguous in the block-major pool: gather whole rows.
    rows = (meta.block_tables * num_layers + layer).flatten()
    kv = pool.view(pool.shape[0] * num_layers, -1).index_select(0, rows)
    kv = kv.view(b, n_blocks, 2, block_size, kv_heads, d).permute(2, 0, 4, 1, 3, 5)
    keys, values = kv.reshape(2, b, kv_heads, n_blocks * block_size, d)  # (B, KVH, S, D)
    assert meta.context_mask is not None
    if q.is_cuda:
        out = F.scaled_dot_product_attention(
            q.view(b, heads, 1, d), keys, values, attn_mask=meta.context_mask, enable_gqa=True
        )
        return out.view(b, heads, d)
    qg = q.view(b, kv_heads, heads // kv_heads, d)  # query heads grouped by their KV head
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * d**-0.5  # (B, KVH, G, S)
    probs = scores.masked_fill(~meta.context_mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(values.dtype), values).view(b, heads, d)
