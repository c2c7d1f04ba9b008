"""The attention rows of ``benchmarks.engine.fused_ops``: decode attention over one layer,
a whole decode step's and a speculative verification's attention over SmolLM2-135M's
layers with scattered blocks, and one prompt's causal attention; each as the torch
reference, the kernel library's op and pdserve's kernel, where built."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels.cpu.ops import decode_attention_op, prefill_attention_op
from engine.model.attention import grouped_decode_sdpa
from engine.model.fused_cpu import ISA

CONTEXT = 300  # decode attention: tokens of KV per sequence
LAYERS = 30  # a decode step's attention: SmolLM2-135M's layers
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, EPS = 576, 1536, 9, 3, 64, 1e-5
Op = Callable[[], object]


def _library_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    schedule: torch.Tensor,
) -> None:
    """The library's attention over the paged pool, causal, as the fused backend calls it."""
    torch.ops._C.cpu_attention_with_kv_cache(
        q, key, value, out, starts, seq_lens, HEAD_DIM**-0.5, True, None, -1, tables, 0.0,
        schedule, None, None,
    )  # fmt: skip


def decode_attention_ops(rows: int, dtype: torch.dtype) -> dict[str, Op]:
    """Decode attention of ``rows`` sequences of ``CONTEXT`` tokens: SDPA over a dense copy
    of their K/V (the torch backend's decode) against the library's over the paged pool."""
    bs, blocks = 16, -(-CONTEXT // 16)
    k, v = (torch.randn(rows * CONTEXT, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    key_cache = torch.zeros(rows * blocks + 1, KV_HEADS, bs, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    tables = torch.arange(1, rows * blocks + 1, dtype=torch.int32).view(rows, blocks)
    offsets = torch.arange(blocks * bs) % bs
    slots = (tables.long().repeat_interleave(bs, 1) * bs + offsets)[:, :CONTEXT].reshape(-1)
    torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, ISA)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    seq_lens = torch.full((rows,), CONTEXT, dtype=torch.int32)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    schedule = torch.ops._C.get_scheduler_metadata(
        rows, HEADS, KV_HEADS, HEAD_DIM, seq_lens, dtype, starts, True, -1, ISA, False, None
    )
    out = torch.empty(rows, HEADS, HEAD_DIM, dtype=dtype)
    dense_k, dense_v = (x.view(rows, CONTEXT, KV_HEADS, HEAD_DIM).transpose(1, 2) for x in (k, v))
    bias = torch.zeros(rows, 1, 1, CONTEXT, dtype=dtype)

    def library() -> None:
        _library_attention(q, key_cache, value_cache, out, starts, seq_lens, tables, schedule)

    ops: dict[str, Op] = {
        "torch": lambda: grouped_decode_sdpa(q, dense_k, dense_v, bias),
        "library": library,
    }
    if (decode_attention := decode_attention_op()) is not None:
        ops["pdserve"] = lambda: decode_attention(
            q, key_cache, value_cache, tables, seq_lens, HEAD_DIM**-0.5
        )
    return ops


def _layer_views(
    num_blocks: int, bs: int, dtype: torch.dtype, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A random pool in the engine's layout (num_blocks, L, 2, block, KVH, D) and, per
    layer, its (K, V) views as (num_blocks, KVH, block, D), as the fused backend takes them."""
    pool = torch.randn(num_blocks, LAYERS, 2, bs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    chunk = bs * KV_HEADS * HEAD_DIM
    shape = (num_blocks, KV_HEADS, bs, HEAD_DIM)
    strides = (LAYERS * 2 * chunk, bs * HEAD_DIM, HEAD_DIM, 1)
    return [
        (
            pool.as_strided(shape, strides, 2 * i * chunk),
            pool.as_strided(shape, strides, (2 * i + 1) * chunk),
        )
        for i in range(LAYERS)
    ]


def step_attention_ops(rows: int, dtype: torch.dtype) -> dict[str, Op]:
    """A whole decode step's attention: ``LAYERS`` layers of ``rows`` sequences of
    ``CONTEXT`` tokens, each sequence's blocks scattered over the pool as a served pool's
    are after some traffic, the pool in the engine's layout (num_blocks, L, 2, block, KVH,
    D). Unlike one layer's op above, whose few MB stay in cache between calls, the step
    reads its K and V from memory, as serving does: the library's kernel against pdserve's
    (no torch row: its dense copy alone would dominate)."""
    bs, blocks = 16, -(-CONTEXT // 16)
    gen = torch.Generator().manual_seed(rows)
    views = _layer_views(rows * blocks + 1, bs, dtype, gen)
    tables = (torch.randperm(rows * blocks, generator=gen) + 1).to(torch.int32).view(rows, blocks)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    seq_lens = torch.full((rows,), CONTEXT, dtype=torch.int32)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    out = torch.empty(rows, HEADS, HEAD_DIM, dtype=dtype)

    def library() -> None:
        schedule = torch.ops._C.get_scheduler_metadata(
            rows, HEADS, KV_HEADS, HEAD_DIM, seq_lens, dtype, starts, True, -1, ISA, False, None
        )
        for key, value in views:
            _library_attention(q, key, value, out, starts, seq_lens, tables, schedule)

    ops: dict[str, Op] = {"library": library}
    if (decode_attention := decode_attention_op()) is not None:

        def pdserve() -> None:
            for key, value in views:
                decode_attention(q, key, value, tables, seq_lens, HEAD_DIM**-0.5)

        ops["pdserve"] = pdserve
    return ops


def verify_attention_ops(drafts: int, context: int) -> dict[str, Op]:
    """A speculative verification's attention: ``LAYERS`` layers of one sequence's
    ``drafts`` + 1 query rows, row j over ``context`` + j tokens of its blocks (scattered),
    bfloat16: the library's kernel with each row a request of its own, pdserve's decode
    kernel with each row a sequence of its own ("apart", the tree before), and with the
    rows given as one sequence's ("together": they run in turn on one core, the context
    from L2 after the first, to the same bits)."""
    bs, rows = 16, drafts + 1
    blocks = -(-(context + rows) // bs)
    gen = torch.Generator().manual_seed(rows)
    views = _layer_views(blocks + 1, bs, torch.bfloat16, gen)
    table = (torch.randperm(blocks, generator=gen) + 1).to(torch.int32).view(1, blocks)
    row_tables = table.expand(rows, blocks).contiguous()
    q = torch.randn(rows, HEADS, HEAD_DIM).to(torch.bfloat16)
    seq_lens = torch.arange(context + 1, context + rows + 1, dtype=torch.int32)
    row_starts = torch.arange(rows + 1, dtype=torch.int32)
    together = torch.tensor([0, rows], dtype=torch.int32)
    out = torch.empty(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    schedule = torch.ops._C.get_scheduler_metadata(
        rows, HEADS, KV_HEADS, HEAD_DIM, seq_lens, torch.bfloat16, row_starts, True, -1, ISA,
        False, None,
    )  # fmt: skip

    def library() -> None:
        for key, value in views:
            _library_attention(q, key, value, out, row_starts, seq_lens, row_tables, schedule)

    ops: dict[str, Op] = {"library": library}
    if (decode_attention := decode_attention_op()) is not None:
        scale = HEAD_DIM**-0.5

        def apart() -> None:
            for key, value in views:
                decode_attention(q, key, value, row_tables, seq_lens, scale)

        def grouped() -> None:
            for key, value in views:
                decode_attention(q, key, value, table, seq_lens, scale, together)

        ops["apart"], ops["together"] = apart, grouped
    return ops


def prefill_attention_ops(tokens: int, dtype: torch.dtype) -> dict[str, Op]:
    """One layer's causal attention of a ``tokens``-token prompt over its blocks (scattered)
    in the pool: torch's SDPA over dense K/V (the torch backend's prefill), the library's
    kernel and pdserve's over the pool."""
    bs, blocks = 16, -(-tokens // 16)
    gen = torch.Generator().manual_seed(tokens)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    key_cache = torch.zeros(blocks + 1, KV_HEADS, bs, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    tables = (torch.randperm(blocks, generator=gen) + 1).to(torch.int32).view(1, blocks)
    offsets = torch.arange(blocks * bs) % bs
    slots = (tables.long().repeat_interleave(bs, 1) * bs + offsets)[:, :tokens].reshape(-1)
    torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, ISA)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.tensor([tokens], dtype=torch.int32)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    schedule = torch.ops._C.get_scheduler_metadata(
        1, HEADS, KV_HEADS, HEAD_DIM, seq_lens, dtype, starts, True, -1, ISA, False, None
    )
    out = torch.empty_like(q)
    dense_q, dense_k, dense_v = (x.transpose(0, 1) for x in (q, k, v))

    def library() -> None:
        _library_attention(q, key_cache, value_cache, out, starts, seq_lens, tables, schedule)

    ops: dict[str, Op] = {
        "torch": lambda: F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, enable_gqa=True
        ),
        "library": library,
    }
    if (prefill_attention := prefill_attention_op()) is not None:
        ops["pdserve"] = lambda: prefill_attention(
            q, key_cache, value_cache, starts, seq_lens, tables, HEAD_DIM**-0.5
        )
    return ops
