"""The torch attention backend: torch ops and SDPA over the paged pool (every device, and
the reference the others are tested against), and the step's metadata it reads.

Who calls what: the runner hands ``prepare_metadata`` one forward's sequences
(``StepBatch``) and gets back the ``AttentionMetadata`` every layer reads; the model then
calls ``attend``, ``rmsnorm`` and ``silu_mul`` per layer. The fused CPU backend
(``engine/model/fused_cpu.py``) is this one with library kernels: it places new tokens by
slot (``paged_in_place``) instead of per-layer rows and rotary tables, and derives its own
``PagedBatch`` in ``prepare``.

On CPU (``dense_decode``) the backend keeps the running decode batch's K/V dense between
steps (``DenseDecodeKV``); the runner tells it which sequences' rows went stale
(``forget``: prefilled or freed) and when a forward failed midway (``step_failed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.model.attention import (
    AttentionMetadata,
    DenseDecodeKV,
    exact_rows,
    paged_attention,
    per_layer_rows,
)
from engine.model.backend import AttentionBackend, AttentionLayer
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary
from wire.params import SamplingParams


@dataclass(frozen=True)
class TorchGeometry:
    """What the torch path's metadata needs of its engine."""

    num_layers: int
    num_heads: int
    block_size: int
    kv_dtype: torch.dtype  # the pool's: a decode step's padding bias is made in it
    rotary: RotaryEmbedding
    device: torch.device


class PagedSequence(Protocol):
    """What the metadata reads of a sequence (engine/kv/sequence.py's)."""

    block_table: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class StepBatch:
    """One forward's B sequences: sequence i runs ``n`` new tokens from position ``start``;
    its block table covers them."""

    spans: Sequence[tuple[PagedSequence, int, int]]  # (sequence, start, n)
    pool: torch.Tensor
    is_decode: bool
    # Speculative verification: k + 1 rows a sequence, each attended to as its decode step
    # would attend to it (the forward runs on decode weights).
    rows_as_decode: bool = False


class TorchBackend(AttentionBackend[AttentionMetadata]):
    """torch ops: SDPA over the pool (a dense copy of the batch's K/V on CPU decode)."""

    def __init__(self, geometry: TorchGeometry, dense_decode: bool = False) -> None:
        self.geometry = geometry
        # CPU only: on CUDA gathering is cheap and a second copy of the KV would cost memory.
        self.dense = DenseDecodeKV() if dense_decode else None

    def forget(self, seqs: Sequence[object]) -> None:
        """``seqs`` were prefilled or freed: their kept dense rows are stale."""
        if self.dense is not None:
            self.dense.forget(list(seqs))

    def step_failed(self) -> None:
        """A forward raised: some layers may have extended the dense K/V, others not."""
        if self.dense is not None:
            self.dense.invalidate()

    def prepare_metadata(self, batch: StepBatch) -> AttentionMetadata:
        """The step's metadata, computed once for every layer (no host sync on CUDA)."""
        spans, g = batch.spans, self.geometry
        meta = self._metadata(batch)
        if batch.rows_as_decode or (batch.is_decode and self.dense is not None):
            # Rows reporting logprobs attend over their own context, as if alone in the step.
            wants = [s.sampling.logprobs is not None for s, _, _ in spans]
            exact = exact_rows(wants, meta.ctx_lens, narrower_only=not batch.rows_as_decode)
            meta = replace(meta, exact_rows=exact)
        if batch.rows_as_decode:
            meta = replace(meta, rows_as_decode=True)
            if self.dense is not None:  # attend over the kept dense K/V, not a gather
                meta = replace(meta, **self._dense_fields(spans, meta, batch.pool))
        return self.prepare(meta, batch.pool, g.num_heads)

    def _metadata(self, batch: StepBatch) -> AttentionMetadata:
        spans, bs, dev = batch.spans, self.geometry.block_size, self.geometry.device
        positions = [p for _, start, n in spans for p in range(start, start + n)]
        width = max(len(seq.block_table) for seq, _, _ in spans)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _, _ in spans]
        ctx_lens = [start + n for _, start, n in spans]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        block_tables = torch.tensor(tables, dtype=torch.long, device=dev)
        slot_blocks = [s.block_table[p // bs] for s, a, n in spans for p in range(a, a + n)]
        fields = self._placement(positions, pos, slot_blocks)
        if batch.is_decode:
            fields.update(self._decode_fields(spans, block_tables, ctx_lens, batch.pool))
        return AttentionMetadata(
            block_tables=block_tables,
            ctx_lens=ctx_lens,
            q_lens=[n for _, _, n in spans],
            is_decode=batch.is_decode,
            positions=pos,
            **fields,
        )

    def _placement(
        self, positions: list[int], pos: torch.Tensor, slot_blocks: list[int]
    ) -> dict[str, Any]:
        """Where each new token's K and V go, per layer (``write_rows``), and its rotary
        tables (``cos_sin``). ``slot_blocks``: (T,) the pool block of each new token."""
        g = self.geometry
        layers, bs = g.num_layers, g.block_size
        blocks = torch.tensor(slot_blocks, dtype=torch.long, device=g.device)
        slot_rows = blocks * (layers * 2 * bs) + pos % bs  # layer 0's K row of each token
        return {
            "write_rows": per_layer_rows(slot_rows, layers, 2 * bs, bs).unbind(0),
            "cos_sin": g.rotary.lookup(pos),
        }

    def _decode_fields(
        self,
        spans: Sequence[tuple[PagedSequence, int, int]],
        block_tables: torch.Tensor,
        ctx_lens: list[int],
        pool: torch.Tensor,
    ) -> dict[str, Any]:
        """Where decode attention reads: the kept dense K/V (CPU) or the pool's blocks."""
        g = self.geometry
        dev = g.device
        rows = self._pool_rows(block_tables)
        fields: dict[str, Any] = {}
        if self.dense is not None:
            seqs: list[object] = [seq for seq, _, _ in spans]
            kv, dense_rows = self.dense.prepare(pool, seqs, ctx_lens, rows)
            fields.update(dense_kv=kv, dense_rows=dense_rows)
            width = max(ctx_lens)
        else:
            fields["gather_rows"] = rows.unbind(0)
            width = block_tables.shape[1] * g.block_size
        slots = torch.arange(width, device=dev)
        ctx = torch.tensor(ctx_lens, device=dev)
        bias = torch.zeros(len(spans), 1, 1, width, dtype=g.kv_dtype, device=dev)
        bias.masked_fill_((slots.unsqueeze(0) >= ctx.unsqueeze(1))[:, None, None, :], float("-inf"))
        fields["attn_bias"] = bias  # (B, 1, 1, S)
        return fields

    def _dense_fields(
        self,
        spans: Sequence[tuple[PagedSequence, int, int]],
        meta: AttentionMetadata,
        pool: torch.Tensor,
    ) -> dict[str, Any]:
        """A verification's rows in the kept dense K/V (CPU), extended in place by each query
        row as a decode step extends it: no copy of the batch's context out of the pool."""
        assert self.dense is not None
        rows = self._pool_rows(meta.block_tables)
        seqs: list[object] = [seq for seq, _, _ in spans]
        kv, dense_rows = self.dense.prepare(pool, seqs, meta.ctx_lens, rows, meta.q_lens)
        return {"dense_kv": kv, "dense_rows": dense_rows}

    def _pool_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        """(L, 2 * B * W): the pool rows of each table's blocks' K, then V, per layer."""
        layers = self.geometry.num_layers
        return per_layer_rows(block_tables.flatten() * (2 * layers), layers, 2, 1).flatten(1)

    def attend(
        self, attn: AttentionLayer, qkv: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.cos_sin is not None, "prepare_metadata looks positions up once per step"
        h, d, q_size = attn.num_heads, attn.head_dim, attn.q_size
        if attn.q_norm is None:  # q and k heads side by side: one rotation for both
            v = qkv[:, q_size + attn.kv_size :].unflatten(1, (attn.num_kv_heads, d))
            qk = apply_rotary(qkv[:, : q_size + attn.kv_size].unflatten(1, (-1, d)), *meta.cos_sin)
            q, k = qk[:, :h], qk[:, h:]  # (T, H, D), (T, KVH, D)
        else:
            q, k, v = attn.split(qkv)
            q, k = apply_rotary(q, *meta.cos_sin), apply_rotary(k, *meta.cos_sin)
        out = paged_attention(pool, attn.layer, meta, q, k, v)  # (T, H, D)
        return out.reshape(qkv.shape[0], q_size)

    def rmsnorm(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        if residual is None:
            return norm(x)
        return norm(residual.add_(x))

    def silu_mul(
        self, gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        # In place on silu's fresh output; up is widened by the multiply if it is narrower.
        out = F.silu(gate_up[:, :inter].to(dtype)).mul_(gate_up[:, inter:])
        return out if out_dtype in (None, dtype) else out.to(out_dtype)
