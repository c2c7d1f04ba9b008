"""The fused CPU attention backend: the torch backend with its row-wise ops done by one
library kernel each (``engine/model/cpu_kernels.py``).

Per layer, around the GEMMs, the torch backend runs ~35 small eager ops (the norms' float
casts and reductions, rotary's cat/neg/mul/add, a cast and an index copy per K and V and
per destination); at 1-32 decode rows each costs a few microseconds of dispatch, which is
most of a step's time outside its math. Here:

* add + RMSNorm: ``fused_add_rms_norm`` (one pass: the residual sum, then its norm);
* rotary: ``rotary_embedding`` over q and k in place, straight in the projection's output;
* K/V store: K and V of a token are adjacent in the projection, so one cast copies both
  and one index copy per destination (pool, dense decode copy) stores both;
* SiLU * up stays torch's: the library's ``silu_and_mul`` measured 1.2-5x slower than
  torch's vectorised ``silu`` and ``mul_`` at 1-256 rows (``benchmarks/results/fused_ops.md``),
  while its add + RMSNorm took 0.2-0.36x and its rotary 0.16-0.19x of torch's time;
* attention: as the torch backend (``engine/model/attention.py``: SDPA; on decode over the
  dense copy the runner keeps between steps).

Equal to ``TorchBackend`` within rounding: the kernels compute in float32 inside and round
once where torch rounds per op (bfloat16 activations), or sum in another order (float32);
``tests/engine/test_fused_cpu.py`` states the tolerances.
"""

from __future__ import annotations

import torch

from engine.model.attention import AttentionMetadata, stored_attention
from engine.model.backend import TORCH, AttentionLayer, TorchBackend
from engine.model.cpu_kernels import CpuKernels, available
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding


class FusedCpuBackend(TorchBackend):
    """``TorchBackend`` with library kernels for add + RMSNorm, rotary and the K/V store
    (CPU only); SiLU * up and attention are the torch backend's."""

    def __init__(self, kernels: CpuKernels, rotary: RotaryEmbedding) -> None:
        self.kernels = kernels
        self._ops = torch.ops._C
        half = rotary.cos.shape[1] // 2
        # (P, D): cos then sin of each position's D / 2 frequencies (the halves of
        # RotaryEmbedding's tables are equal), the layout rotary_embedding reads.
        self.cos_sin = torch.cat((rotary.cos[:, :half], rotary.sin[:, :half]), dim=1).contiguous()

    def attend(
        self, attn: AttentionLayer, qkv: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.positions is not None, "the runner sets positions for this backend"
        t, h, d = qkv.shape[0], attn.num_heads, attn.head_dim
        q_size, kv_size = attn.q_size, attn.kv_size
        cos_sin = self.cos_sin if self.cos_sin.dtype == qkv.dtype else self.cos_sin.to(qkv.dtype)
        if attn.q_norm is None:
            # In place in qkv: q (T, q_size) and k (T, kv_size) are strided row views.
            self._ops.rotary_embedding(
                meta.positions, qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], d, cos_sin, True
            )
            q, kv = qkv[:, :q_size].view(t, h, d), qkv[:, q_size:]  # (T, H, D), (T, 2 * kv)
        else:  # Qwen3: per-head norms first; q, k are fresh (T, H|KVH, D) tensors
            q, k, v = attn.split(qkv)
            self._ops.rotary_embedding(
                meta.positions, q.view(t, -1), k.view(t, -1), d, cos_sin, True
            )
            kv = torch.cat((k.view(t, -1), v.reshape(t, -1)), dim=1)  # (T, 2 * kv)
        # One copy of K and V in the cache's dtype: (T, 2 * kv_size) rows = (2T, kv_size),
        # row 2i token i's K, row 2i + 1 its V; stored by one index copy per destination.
        kv_rows = kv.to(pool.dtype).contiguous().view(2 * t, kv_size)
        rows = pool.view(-1, kv_size)
        assert meta.kv_rows is not None
        rows.index_copy_(0, meta.kv_rows[attn.layer], kv_rows)
        if meta.dense_kv is not None and meta.dense_kv_rows is not None:
            dense = meta.dense_kv[attn.layer].view(-1, kv_size)
            dense.index_copy_(0, meta.dense_kv_rows, kv_rows)
        k = v = q  # decode attention reads them back from where they were written
        if not meta.is_decode:  # fresh prompts attend over them: as cached, in q's dtype
            k, v = kv_rows.view(t, 2, -1, d).to(q.dtype).unbind(1)  # (T, KVH, D) each
        return stored_attention(pool, attn.layer, meta, q, k, v).reshape(t, q_size)

    def rmsnorm(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As ``TorchBackend.rmsnorm``; with ``residual``, ``x`` (the sublayer's output,
        read by nobody after) is overwritten by the result."""
        if residual is None:
            out = torch.empty_like(x)
            self._ops.rms_norm(out, x, norm.weight, norm.eps)
            return out
        self._ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return x


def cpu_backend(attention_backend: str, rotary: RotaryEmbedding) -> TorchBackend:
    """The backend of a CPU runner: fused where ``attention_backend`` is ``auto`` and the
    kernel library loads on this CPU, else the torch reference (``--attention-backend
    torch`` forces it)."""
    kernels = available() if attention_backend == "auto" else None
    return TORCH if kernels is None else FusedCpuBackend(kernels, rotary)
