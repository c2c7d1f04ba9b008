"""Paged attention kernels equal the torch reference (engine/model/attention.py) on the pool.

Shapes are tiny (the interpreter runs every program in Python) but cover GQA ratios 1, 4
and 8, contexts of 1..100 tokens across block boundaries, pages smaller than a key tile,
empty KV splits, padding rows, and batches mixing fresh prompts with continuation chunks.
"""

from __future__ import annotations

import pytest
import torch

from engine.cuda.kernels.decode_attention import MAX_SPLITS, decode_attention, num_kv_splits
from engine.cuda.kernels.extend_attention import extend_attention
from engine.model.attention import _causal_sdpa, _gather_context
from tests.engine.kernels.conftest import DEVICE, random_pool, random_tables

CTX_LENS = [1, 2, 15, 16, 17, 33, 100]
LAYERS, HEAD_DIM = 2, 16


def _reference(
    q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, ctx: list[int], q_lens: list[int]
) -> torch.Tensor:
    """The torch path's continuation-chunk attention, sequence by sequence, on layer 1."""
    out, start = [], 0
    for i, (c, n) in enumerate(zip(ctx, q_lens)):
        k, v = _gather_context(pool.float(), 1, tables[i].long(), c)
        out.append(_causal_sdpa(q[start : start + n].float(), k, v))
        start += n
    return torch.cat(out)


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "splits"),
    [(2, 2, 16, 3), (8, 2, 8, 1), (8, 1, 16, MAX_SPLITS)],
    ids=["gqa1-3splits", "gqa4-page8-1split", "gqa8-16splits"],
)
def test_decode_matches_reference(heads: int, kv_heads: int, block_size: int, splits: int) -> None:
    pool = random_pool(112, LAYERS, block_size, kv_heads, HEAD_DIM, seed=heads + splits)
    tables = random_tables(CTX_LENS, block_size, 112, seed=block_size)
    g = torch.Generator().manual_seed(splits)
    b = len(CTX_LENS)
    q = torch.randn(b, heads, HEAD_DIM, generator=g).to(DEVICE)
    rows = torch.arange(b, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, pool, 1, tables, rows, _ints(CTX_LENS), splits)
    want = _reference(q, pool, tables, CTX_LENS, [1] * b)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


def test_decode_reads_rows_by_index_and_pads_to_zeros() -> None:
    """Rows of a persistent table picked by ``seq_rows``; a context of 0 gives 0, not NaN."""
    pool = random_pool(32, LAYERS, 16, 2, HEAD_DIM, seed=7, dtype=torch.float16)
    ctx = [17, 0, 40]
    tables = random_tables([17, 40, 40, 40], 16, 32, seed=3)  # 4 rows, rows 0 and 2 used
    q = torch.randn(3, 4, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q = q.half()
    out = decode_attention(q, pool, 1, tables, _ints([0, 1, 2]), _ints(ctx), 4)
    assert out.dtype == torch.float16
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    want = _reference(q[[0, 2]], pool, tables[[0, 2]], [17, 40], [1, 1])
    torch.testing.assert_close(out[[0, 2]].float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(2, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"]
)
def test_extend_matches_reference_on_mixed_chunks(heads: int, kv_heads: int) -> None:
    # Fresh prompts (ctx == q_len) next to chunks continuing cached context.
    ctx = [1, 17, 40, 100, 16, 2, 33]
    q_lens = [1, 17, 5, 30, 1, 1, 33]
    pool = random_pool(64, LAYERS, 16, kv_heads, HEAD_DIM, seed=heads)
    tables = random_tables(ctx, 16, 64, seed=heads)
    q = torch.randn(sum(q_lens), heads, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    q = q.to(DEVICE)
    starts = _ints([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    rows = torch.arange(len(ctx), dtype=torch.int32, device=DEVICE)
    out = extend_attention(q, pool, 1, tables, rows, _ints(ctx), starts, max(q_lens))
    torch.testing.assert_close(out, _reference(q, pool, tables, ctx, q_lens), atol=2e-5, rtol=1e-5)


def test_num_kv_splits_fills_the_gpu_within_bounds() -> None:
    assert num_kv_splits(batch=1, kv_heads=8, max_ctx=8192, num_sms=132) == MAX_SPLITS
    assert num_kv_splits(batch=1, kv_heads=8, max_ctx=300, num_sms=132) == 2  # >= 256 each
    assert num_kv_splits(batch=256, kv_heads=8, max_ctx=8192, num_sms=132) == 1
    assert num_kv_splits(batch=4, kv_heads=2, max_ctx=8192, num_sms=132) == 16
    assert num_kv_splits(batch=16, kv_heads=2, max_ctx=8192, num_sms=132) == 9
