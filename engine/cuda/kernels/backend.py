"""The Triton attention backend (the CUDA path) of the decoder's one layer loop.

Behind ``engine.model.backend.AttentionBackend``: rotary and the KV write are one kernel,
attention reads the pool in place (decode: split-K over each sequence's blocks; prefill and
extend: causal over the new tokens and everything before them), and add + RMSNorm and
SiLU * up are fused. The linear layers and the embedding are the model's own modules.

NOTE: nothing here syncs with the host or allocates on the host, so a decode forward can
be captured in a CUDA graph: every per-step input is a view of ``engine.cuda.graphs
.StepInputs``'s device buffer, and ``max_q_len`` / ``num_splits`` are launch shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cuda.kernels.decode_attention import decode_attention
from engine.cuda.kernels.extend_attention import extend_attention
from engine.cuda.kernels.fused_ops import rmsnorm, silu_mul
from engine.cuda.kernels.rope_store import rope_and_store
from engine.model.backend import AttentionBackend, AttentionLayer
from engine.model.layers import RMSNorm


@dataclass(frozen=True)
class KernelBatch:
    """One step's inputs, on the model's device. T tokens of B sequences, int32 throughout."""

    token_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slots: torch.Tensor  # (T,) pool slot (block * block_size + offset) of each token; < 0: none
    seq_rows: torch.Tensor  # (B,) row of ``block_tables`` holding each sequence's blocks
    ctx_lens: torch.Tensor  # (B,) context length after this step
    q_starts: torch.Tensor  # (B + 1,) sequence b's tokens are [q_starts[b], q_starts[b + 1])
    block_tables: torch.Tensor  # (R, W) persistent table (engine/kv/block_table_rows.py)
    is_decode: bool  # one token per sequence: T == B
    max_q_len: int  # prefill grid size; 1 for decode
    num_splits: int  # decode only: KV splits per sequence (decode_attention)
    logits_rows: torch.Tensor | None = None  # (N,) rows whose hidden state is returned


class TritonBackend(AttentionBackend[KernelBatch]):
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin  # (P, D) rotary tables (engine/model/rope.py)

    def attend(
        self, attn: AttentionLayer, qkv: torch.Tensor, pool: torch.Tensor, meta: KernelBatch
    ) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = attn.split(qkv)  # strided views of qkv (no copies) unless Qwen3's norms
        rope_and_store(q, k, v, self.cos, self.sin, meta.positions, meta.slots, pool, attn.layer)
        tables, rows, ctx = meta.block_tables, meta.seq_rows, meta.ctx_lens
        if meta.is_decode:
            o = decode_attention(q, pool, attn.layer, tables, rows, ctx, meta.num_splits)
        else:
            o = extend_attention(
                q, pool, attn.layer, tables, rows, ctx, meta.q_starts, meta.max_q_len
            )
        return o.view(t, attn.q_size)  # (T, H, D) -> (T, q_size)

    def rmsnorm(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return rmsnorm(x, norm.weight, norm.eps, residual=residual)

    def silu_mul(
        self, gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        # Dense CUDA projections are in the model's dtype already (no cast in a graph).
        out = silu_mul(gate_up if gate_up.dtype == dtype else gate_up.to(dtype))
        return out if out_dtype in (None, dtype) else out.to(out_dtype)
