"""The decoder's forward on the kernels of this package (the CUDA path).

Same weights and the same math as ``engine.model.causal_lm.CausalLM.forward``, in a different
order of operations: the residual stream is carried separately and each sublayer's
output is added to it by the next norm (``rmsnorm(..., residual=)``); gate and up are one
GEMM over the fused ``gate_up`` weight; rotary and the KV write are one kernel; attention
reads the pool in place. The linear layers and the embedding are the model's own modules.

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
from engine.model.causal_lm import CausalLM, DecoderLayer


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


@torch.inference_mode()
def forward_hidden(model: CausalLM, pool: torch.Tensor, batch: KernelBatch) -> torch.Tensor:
    """-> final-normed hidden states (N, hidden) of ``batch.logits_rows`` (all T if None).

    The vocabulary projection is left to the caller (``logits``), outside any CUDA graph:
    a graph's outputs stay allocated per batch-size bucket, and (bucket, vocab) float32
    logits for every bucket would be gigabytes.
    """
    residual = model.embed(batch.token_ids)  # (T, hidden)
    layers = [model.layer(i) for i in range(len(model.layers))]
    h = rmsnorm(residual, layers[0].input_norm.weight, layers[0].input_norm.eps)
    for i, layer in enumerate(layers):
        out = _attention(layer, h, model, pool, batch)
        norm = layer.post_attn_norm
        h = rmsnorm(out, norm.weight, norm.eps, residual=residual)
        gate_up = layer.mlp.gate_up(h)  # (T, 2 * inter): one GEMM
        out = layer.mlp.down(silu_mul(gate_up))
        norm = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
        h = rmsnorm(out, norm.weight, norm.eps, residual=residual)
    return h if batch.logits_rows is None else h[batch.logits_rows]


def logits(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """(N, hidden) -> float32 logits (N, vocab), as ``CausalLM.forward`` returns them."""
    with torch.inference_mode():
        return model.lm_head(hidden).float()


def _attention(
    layer: DecoderLayer, x: torch.Tensor, model: CausalLM, pool: torch.Tensor, batch: KernelBatch
) -> torch.Tensor:
    """Self-attention sublayer: (T, hidden) normed input -> (T, hidden) output projection."""
    attn = layer.attn
    t = x.shape[0]
    qkv = attn.qkv(x)  # (T, q_size + 2 * kv_size)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(t, attn.num_heads, attn.head_dim)  # strided views of qkv: no copies
    k = k.view(t, attn.num_kv_heads, attn.head_dim)
    v = v.view(t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)  # Qwen3: per-head norm before rotary
    rot = model.rotary
    rope_and_store(q, k, v, rot.cos, rot.sin, batch.positions, batch.slots, pool, attn.layer)
    if batch.is_decode:
        o = decode_attention(
            q, pool, attn.layer, batch.block_tables, batch.seq_rows, batch.ctx_lens,
            batch.num_splits,
        )  # fmt: skip
    else:
        o = extend_attention(
            q, pool, attn.layer, batch.block_tables, batch.seq_rows, batch.ctx_lens,
            batch.q_starts, batch.max_q_len,
        )  # fmt: skip
    return attn.o(o.view(t, attn.q_size))  # (T, H, D) -> (T, hidden)
