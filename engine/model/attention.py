"""Attention over the paged KV pool, for a flat batch of tokens from many sequences.

The batch is ``T`` tokens: sequence ``i`` contributes ``q_lens[i]`` consecutive tokens at
positions ``[ctx_lens[i] - q_lens[i], ctx_lens[i])``. Each layer first writes the new K/V
into the pool, then attends:

* a decode batch (every ``q_len == 1``) attends with one grouped SDPA call (the query
  heads of each KV head as rows of one block) over a padded (B, S)
  context laid out (2, B, S, KVH, D), through strided (B, KVH, S, D) views, padding
  hidden by an additive bias. On CPU that context is ``DenseDecodeKV``, kept between
  steps and extended by one token per step; on CUDA one ``index_select`` per layer
  gathers it from the pool. Either way no rearranging copy: it is the layout SDPA reads;
* a prefill batch runs one causal SDPA call per run of consecutive fresh sequences of
  equal length (a pure view of the flat batch), and one per sequence otherwise; a
  sequence with earlier chunks already in the pool reads its whole context back.

The runner computes every index once per step (``AttentionMetadata``), not per layer.
SDPA is PyTorch's fused kernel on every device (flash / memory-efficient on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a flat token batch reads and writes KV. Shapes: B sequences, T tokens, L layers.

    Row indices address the pool ``(num_blocks, L, 2, block_size, KVH, D)`` flattened two
    ways: ``write_rows`` index token rows ``(num_blocks * L * 2 * block_size, KVH * D)``,
    ``gather_rows`` index block rows ``(num_blocks * L * 2, block_size * KVH * D)``.
    """

    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with block 0
    ctx_lens: list[int]  # (B,) KV length after this step, new tokens included
    q_lens: list[int]  # (B,) new tokens per sequence; sum == T
    is_decode: bool
    # L x (2, T) int64: K row, V row of each new token (empty where the backend is
    # ``paged_in_place``)
    write_rows: tuple[torch.Tensor, ...] = ()
    # Speculative verification: each query row is attended to as a decode step would
    # attend to it (``_decode_rows_attention``), so its logits carry that step's bits.
    rows_as_decode: bool = False
    # ... and these sequences' rows (indices into the batch) get exactly a one-request
    # decode step's bits, at a higher cost (those that asked for logprobs). Also in a CPU
    # decode batch (``dense_kv``): rows whose context is shorter than the batch's widest.
    exact_rows: frozenset[int] = frozenset()
    # ... at one thread (batch-invariant serving): the CPU SDPA kernel's reduction order
    # for a one-row call moves with the thread count, which a CPU worker's core lease
    # changes from step to step (``_one_thread``).
    exact_one_thread: bool = False
    gather_rows: tuple[torch.Tensor, ...] = ()  # decode only: L x (2 * B * max_blocks,)
    attn_bias: torch.Tensor | None = None  # decode only: (B, 1, 1, S) 0 or -inf, model dtype
    # CPU decode and verification: the batch's K/V kept dense between steps (see
    # DenseDecodeKV), and the rows of (2 * B * cap, KVH * D) each layer's new K, V go to:
    # (2, T), T = B for a decode step.
    dense_kv: torch.Tensor | None = None  # (L, 2, B, cap, KVH, D)
    dense_rows: torch.Tensor | None = None
    # The new tokens' rotary tables, looked up once per step: cos, sin (T, 1, D).
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    # The new tokens' positions (T,), and what a backend adds in ``prepare`` (the fused CPU
    # backend's ``PagedBatch``, engine/model/fused_cpu.py).
    positions: torch.Tensor | None = None
    # Where the backend is ``paged_in_place``: (T,) each new token's slot in the pool,
    # block * block_size + offset.
    slots: torch.Tensor | None = None
    paged: object | None = None


def write_kv(
    pool: torch.Tensor, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v: (T, kv_heads, head_dim) into their slots of ``layer``."""
    rows = pool.view(-1, pool.shape[4] * pool.shape[5])  # (NB * L * 2 * bs, KVH * D)
    t = k.shape[0]
    k, v = k.to(pool.dtype), v.to(pool.dtype)  # the cache may be narrower than activations
    rows.index_copy_(0, meta.write_rows[layer][0], k.reshape(t, -1))
    rows.index_copy_(0, meta.write_rows[layer][1], v.reshape(t, -1))
    if meta.dense_kv is not None and meta.dense_rows is not None:
        dense = meta.dense_kv[layer].view(-1, rows.shape[1])  # (2 * B * cap, KVH * D)
        dense.index_copy_(0, meta.dense_rows[0], k.reshape(t, -1))
        dense.index_copy_(0, meta.dense_rows[1], v.reshape(t, -1))


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
        # In the cache's dtype (the bias is made in it too), back to the activations'.
        return _decode_attention(pool, layer, meta, q.to(pool.dtype)).to(q.dtype)
    return _prefill_attention(pool, layer, meta, q, k, v)


def _prefill_attention(
    pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    outputs = []
    start, i, b = 0, 0, len(meta.q_lens)
    while i < b:
        n = meta.q_lens[i]
        # Rows as decode rows (a verification; every prefill row when batch-invariant,
        # engine/model/batch_invariance.py): over the context in the pool, fresh or not.
        if n != meta.ctx_lens[i] or meta.rows_as_decode:
            if meta.rows_as_decode and meta.dense_kv is not None:  # CPU verification
                ki, vi = meta.dense_kv[layer, :, i, : meta.ctx_lens[i]]  # (c, KVH, D) views
            else:
                ki, vi = _gather_context(pool, layer, meta.block_tables[i], meta.ctx_lens[i])
            if meta.rows_as_decode:
                exact = i in meta.exact_rows
                qi = q[start : start + n]
                outputs.append(_decode_rows_attention(qi, ki, vi, exact, meta.exact_one_thread))
            else:
                ki, vi = ki.to(q.dtype), vi.to(q.dtype)
                outputs.append(_causal_sdpa(q[start : start + n], ki, vi))
            start, i = start + n, i + 1
            continue
        # No earlier chunk: the fresh K/V are the whole context. Consecutive fresh
        # sequences of one length are a (g, n) view of the flat batch: one SDPA call.
        g = 1
        while i + g < b and meta.q_lens[i + g] == n == meta.ctx_lens[i + g]:
            g += 1
        end = start + g * n
        kf, vf = _as_cached(k[start:end], pool.dtype), _as_cached(v[start:end], pool.dtype)
        outputs.append(_fresh_sdpa(q[start:end], kf, vf, g))
        start, i = end, i + g
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Fresh K or V as a later chunk will read them back: rounded to the cache's dtype.

    NOTE: so a prompt's KV does not depend on how it was split: computed in one chunk, in
    several, or after a prefix-cache hit, its queries attend over the same values.
    """
    return x if x.dtype == cache_dtype else x.to(cache_dtype).to(x.dtype)


def _gather_context(
    pool: torch.Tensor, layer: int, block_table: torch.Tensor, ctx_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n_blocks = -(-ctx_len // pool.shape[3])
    kv = pool[block_table[:n_blocks], layer]  # (n, 2, block_size, kv_heads, D)
    kv = kv.transpose(0, 1).flatten(1, 2)[:, :ctx_len]  # (2, ctx_len, kv_heads, D)
    return kv[0], kv[1]  # in the cache's dtype


def _fresh_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: int) -> torch.Tensor:
    """q: (g * n, H, D), k, v: (g * n, KVH, D): g whole sequences of n tokens each."""
    t, heads, d = q.shape
    qh, kh, vh = (x.view(g, t // g, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(t, heads, d)  # (g, H, n, D) -> (g * n, H, D)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (n, H, D) are the last n positions of a context k, v: (c, KVH, D)."""
    if q.is_cuda:
        return grouped_causal_sdpa(q, k, v)
    n, c = q.shape[0], k.shape[0]
    # NOTE: 4-D inputs: CPU SDPA takes its fused kernel only with a batch dimension.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, heads, len, D)
    # Query j sits at position c - n + j and sees keys 0..c - n + j.
    mask = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(diagonal=c - n)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def grouped_causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``_causal_sdpa`` with the query heads of each KV head as rows of one query block:
    q (n, H, D), the last n positions of a context k, v (c, KVH, D) -> (n, H, D).

    As ``grouped_decode_sdpa``: equal head counts on both sides, so CUDA's fused kernels
    take the causal mask (mask + ``enable_gqa`` would fall back to the math kernel).
    """
    n, heads, d = q.shape
    c, kv_heads = k.shape[0], k.shape[1]
    g = heads // kv_heads
    # Row j * g + i of KV head h is query token j of head h * g + i.
    qh = q.view(n, kv_heads, g, d).transpose(0, 1).reshape(1, kv_heads, n * g, d)
    kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))  # (1, KVH, c, D)
    mask = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(diagonal=c - n)
    mask = mask.repeat_interleave(g, dim=0)  # (n * g, c)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)  # (1, KVH, n * g, D)
    return out[0].view(kv_heads, n, g, d).transpose(0, 1).reshape(n, heads, d)


def _decode_rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exact: bool, one_thread: bool = False
) -> torch.Tensor:
    """q: (n, H, D), the last n positions of a context k, v: (c, KVH, D) in the cache's
    dtype -> (n, H, D) in q's dtype, computed as ``_decode_attention`` computes a decode
    step's rows: in the cache's dtype, query heads grouped per KV head, a 0 / -inf bias.

    ``exact``: one SDPA call per row over exactly the context that row sees, so each row
    gets the bits a one-request decode step would give it (logprobs equal to speculation
    off); ``one_thread``: those calls at one thread (``AttentionMetadata.exact_one_thread``).
    Otherwise one call for all n rows: the CPU kernel's reduction order depends on the key
    width, so the masked slots past a row's context move its logits by a few
    bfloat16 roundings (~4e-4 in logprob, as decoding beside a longer request does),
    for less than n calls cost over a long context.
    NOTE: the causal-prefill path (``_causal_sdpa``) computes in the activations' dtype
    (~1e-3 from decode with a bfloat16 cache).
    """
    n, heads, d = q.shape
    c, kv_heads = k.shape[0], k.shape[1]
    qc = q.to(k.dtype)
    kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))  # (1, KVH, c, D)
    if exact:
        out = torch.empty(n, heads, d, dtype=k.dtype, device=q.device)
        with _one_thread(one_thread):
            for j in range(n):
                s = c - n + j + 1  # query j sits at position s - 1
                bias = torch.zeros(1, 1, 1, s, dtype=k.dtype, device=q.device)
                out[j] = grouped_decode_sdpa(qc[j : j + 1], kh[:, :, :s], vh[:, :, :s], bias)[0]
        return out.to(q.dtype)
    g = heads // kv_heads
    # Row j * g + i of KV head h is query token j of head h * g + i (as grouped_causal_sdpa).
    qh = qc.view(n, kv_heads, g, d).transpose(0, 1).reshape(1, kv_heads, n * g, d)
    seen = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(diagonal=c - n)
    bias = torch.zeros(n, c, dtype=k.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    bias = bias.repeat_interleave(g, dim=0).view(1, 1, n * g, c)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)  # (1, KVH, n * g, D)
    return out[0].view(kv_heads, n, g, d).transpose(0, 1).reshape(n, heads, d).to(q.dtype)


def _decode_attention(
    pool: torch.Tensor, layer: int, meta: AttentionMetadata, q: torch.Tensor
) -> torch.Tensor:
    b, _, d = q.shape
    assert meta.attn_bias is not None
    s = meta.attn_bias.shape[-1]
    if meta.dense_kv is not None:
        kv = meta.dense_kv[layer, :, :, :s]  # (2, B, S, KVH, D), strided
    else:
        block_size, kv_heads = pool.shape[3], pool.shape[4]
        blocks = pool.view(-1, block_size * kv_heads * d)  # (NB * L * 2, bs * KVH * D)
        kv = blocks.index_select(0, meta.gather_rows[layer]).view(2, b, s, kv_heads, d)
    keys, values = kv.transpose(2, 3)  # each (B, KVH, S, D), strided views
    # Grouped on every device: on CUDA it keeps the fused kernels; on CPU the fused kernel
    # with equal head counts is ~25 % faster than enable_gqa's (measured at B 1-8).
    bias = meta.attn_bias
    if len(meta.exact_rows) < b:
        out = grouped_decode_sdpa(q, keys, values, bias)
    else:  # every row is recomputed below (batch-invariant serving)
        out = torch.empty_like(q)
    with _one_thread(meta.exact_one_thread):
        for i in meta.exact_rows:
            # NOTE: the CPU kernel's reduction order depends on the key width S, so a row
            # padded to a longer neighbour's context gets other bits than it would alone
            # (a few bfloat16 roundings). Alone, a CPU decode step's S is its context: the
            # row is recomputed over exactly that, for a request that reports logprobs.
            s = meta.ctx_lens[i]
            ks, vs = keys[i : i + 1, :, :s], values[i : i + 1, :, :s]
            out[i] = grouped_decode_sdpa(q[i : i + 1], ks, vs, bias[i : i + 1, ..., :s])[0]
    return out


@contextmanager
def _one_thread(on: bool) -> Iterator[None]:
    """With ``on``, the block runs at one thread, then at the thread count it found.

    NOTE: the CPU SDPA kernel splits a one-row call's work by the thread count, so its
    sums run in another order at one thread than at two (seen at most context lengths);
    a CPU worker's core lease (transport/core_lease.py) grants 1 or 2 threads a step by
    what the other workers do. One thread is also the faster for a one-row call.
    """
    threads = torch.get_num_threads() if on else 1
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def grouped_decode_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """One decode token per sequence, with the query heads of each KV head as the rows of
    one query block: q (B, H, D), keys/values (B, KVH, S, D), bias (B, 1, 1, S) -> (B, H, D).

    Equal to SDPA with ``enable_gqa=True`` (query head h reads KV head h // (H / KVH)), but
    with equal head counts on both sides, so CUDA's fused kernels take the mask instead of
    falling back to the math kernel, which would expand K/V per query head in float32.
    """
    b, heads, d = q.shape
    kv_heads = keys.shape[1]
    out = F.scaled_dot_product_attention(
        q.view(b, kv_heads, heads // kv_heads, d), keys, values, attn_mask=bias
    )
    return out.reshape(b, heads, d)


class DenseDecodeKV:
    """CPU decode: the running batch's K/V kept dense between steps, (L, 2, B, cap, KVH, D).

    Gathering every sequence's blocks out of the paged pool costs a copy of the batch's
    whole KV per layer per step. While the batch is the same, a step only adds one token
    per sequence, so the dense copy is kept and extended in place (the pool is written
    too: it stays the source of truth). Any other change rebuilds it from the pool: a
    sequence joins or leaves, a context that did not grow by exactly one, a sequence the
    runner prefilled or freed (``forget``), a forward that failed.
    """

    def __init__(self) -> None:
        self.seqs: tuple[object, ...] = ()  # the batch rows' Sequence objects (held: no id reuse)
        self.ctx_lens: list[int] = []
        self.kv: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None  # storage of kv, kept across rebuilds
        self._scratch: torch.Tensor | None = None  # gather output, kept across rebuilds

    def forget(self, seqs: list[object]) -> None:
        if any(s is t for s in seqs for t in self.seqs):
            self.invalidate()

    def invalidate(self) -> None:
        self.seqs, self.ctx_lens, self.kv = (), [], None

    def prepare(
        self,
        pool: torch.Tensor,
        seqs: list[object],
        ctx_lens: list[int],
        rows: torch.Tensor,
        q_lens: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense K/V for this step, and where each layer writes its new K, V: (2, T).

        ``rows``: (L, 2 * B * W) block rows of the batch (as ``gather_rows``), used on a
        rebuild. ``q_lens``: new tokens per sequence (None: one each, a decode step; a
        verification has k + 1). Positions < ctx_len - q_len are filled; the new tokens'
        layer writes the rest.
        NOTE: kept, not rebuilt, while every sequence needs no position past those written
        here before: a verification writes its drafts' K/V, and of them the positions its
        sequence kept (``commit_verified``) hold the right values, the others are needed
        again only after a later step has written them anew.
        """
        q_lens = q_lens if q_lens is not None else [1] * len(seqs)
        same = len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs))
        grown = same and all(c - q <= p for c, q, p in zip(ctx_lens, q_lens, self.ctx_lens))
        if not grown or self.kv is None or max(ctx_lens) > self.kv.shape[3]:
            self.kv = self._rebuild(pool, len(seqs), max(ctx_lens), rows)
        self.seqs, self.ctx_lens = tuple(seqs), list(ctx_lens)
        b, cap = len(seqs), self.kv.shape[3]
        pos = torch.tensor(
            [i * cap + p for i, (c, q) in enumerate(zip(ctx_lens, q_lens)) for p in range(c - q, c)]
        )
        return self.kv, torch.stack((pos, pos + b * cap))

    def _rebuild(
        self, pool: torch.Tensor, b: int, max_ctx: int, rows: torch.Tensor
    ) -> torch.Tensor:
        num_layers, block_size, kv_heads, d = pool.shape[1], pool.shape[3], *pool.shape[4:]
        width = rows.shape[1] // (2 * b) * block_size  # slots the block tables cover
        cap = -(-(max_ctx + 64) // block_size) * block_size  # ~64 steps until a regrow
        shape = (num_layers, 2, b, cap, kv_heads, d)
        # NOTE: buffers are reused while big enough: fresh ones of this size cost page
        # faults comparable to the copy itself.
        if self._buf is None or self._buf.numel() < math.prod(shape):
            self._buf = torch.empty(shape, dtype=pool.dtype)
        kv = self._buf.view(-1)[: math.prod(shape)].view(shape)
        blocks = pool.view(-1, block_size * kv_heads * d)
        if self._scratch is None or self._scratch.shape[0] < rows.numel():
            self._scratch = torch.empty(rows.numel(), blocks.shape[1], dtype=pool.dtype)
        gathered = torch.index_select(blocks, 0, rows.flatten(), out=self._scratch[: rows.numel()])
        kv[:, :, :, :width] = gathered.view(num_layers, 2, b, width, kv_heads, d)
        # NOTE: slots past a context are masked, but a masked NaN would still poison SDPA:
        # the tail no block covers yet starts as zeros, not as uninitialised memory.
        kv[:, :, :, width:].zero_()
        return kv


def per_layer_rows(
    base: torch.Tensor, num_layers: int, layer_stride: int, v_stride: int
) -> torch.Tensor:
    """``base`` (N,) pool rows of layer 0's K -> (L, 2, N) rows of layer l's K, then V.

    A block's rows run (layer, K|V, slot): a layer is ``layer_stride`` rows further on,
    and V ``v_stride`` rows after K.
    """
    layers = torch.arange(num_layers, device=base.device).view(-1, 1, 1) * layer_stride
    kv = torch.tensor([0, v_stride], device=base.device).view(1, 2, 1)
    return base.view(1, 1, -1) + layers + kv


def exact_rows(
    wants_logprobs: list[bool], ctx_lens: list[int], narrower_only: bool
) -> frozenset[int]:
    """The rows of a CPU step whose attention is recomputed over their own context alone:
    those of requests reporting logprobs (``narrower_only``: only those whose context is
    shorter than the batch's widest), so they report what a one-request step would."""
    width = max(ctx_lens)
    return frozenset(
        i
        for i, (wants, n) in enumerate(zip(wants_logprobs, ctx_lens, strict=True))
        if wants and (not narrower_only or n < width)
    )
