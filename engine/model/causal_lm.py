"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV pool.

The model knows tokens, attention metadata and an attention backend, nothing about
requests. The per-architecture differences are two flags of ``ModelConfig``: ``qkv_bias``
(Qwen2) and ``qk_norm`` (Qwen3: RMSNorm over each head of q and k, before rotary).

One layer loop serves every device: the residual stream is carried apart and each
sublayer's output is added to it by the next norm (``backend.rmsnorm(out, norm,
residual=)``), which is ``x + sublayer(x)`` rounding for rounding; what a device runs
for attention and the ops between the GEMMs is its backend's (``engine/model/backend.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.direct_attrs import DirectAttrs
from engine.model.backend import AttentionBackend, Meta
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.rope import RotaryEmbedding
from engine.weights.linear import Embedding, Linear


class SelfAttention(DirectAttrs):
    def __init__(
        self, m: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = m.num_heads, m.num_kv_heads, m.head_dim
        self.q_size = m.num_heads * m.head_dim
        self.kv_size = m.num_kv_heads * m.head_dim
        out_features = self.q_size + 2 * self.kv_size
        self.qkv = Linear(m.hidden_size, out_features, m.qkv_bias, dtype, device)
        self.o = Linear(self.q_size, m.hidden_size, False, dtype, device)
        self.q_norm: RMSNorm | None = (
            RMSNorm(m.head_dim, m.rms_norm_eps, dtype, device) if m.qk_norm else None
        )
        self.k_norm: RMSNorm | None = (
            RMSNorm(m.head_dim, m.rms_norm_eps, dtype, device) if m.qk_norm else None
        )

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, q_size + 2 * kv_size) -> q (T, H, D), k, v (T, KVH, D): strided views of
        ``qkv``, except q and k after Qwen3's per-head norms."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(1, (self.num_heads, self.head_dim))
        k = k.unflatten(1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(
        self, x: torch.Tensor, pool: torch.Tensor, meta: Meta, backend: AttentionBackend[Meta]
    ) -> torch.Tensor:
        """(T, hidden) normed input -> (T, hidden) output projection, in x's dtype."""
        qkv = self.qkv.native(x) if backend.takes_kernel_dtype else self.qkv(x)
        out = backend.attend(self, qkv, pool, meta)  # (T, q_size)
        return self.o(out, x.dtype)


class DecoderLayer(DirectAttrs):
    def __init__(
        self, m: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.input_norm = RMSNorm(m.hidden_size, m.rms_norm_eps, dtype, device)
        self.attn: SelfAttention = SelfAttention(m, layer, dtype, device)
        self.post_attn_norm = RMSNorm(m.hidden_size, m.rms_norm_eps, dtype, device)
        self.mlp: GatedMLP = GatedMLP(m.hidden_size, m.intermediate_size, dtype, device)


class CausalLM(DirectAttrs):
    def __init__(
        self, m: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = m
        self.embed = Embedding(m.vocab_size, m.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(m, i, dtype, device) for i in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps, dtype, device)
        # Tied checkpoints: the loader builds the head from the embedding's matrix.
        self.lm_head = Linear(m.hidden_size, m.vocab_size, False, dtype, device)
        self.rotary = RotaryEmbedding(
            m.head_dim, max_positions, m.rope_theta, m.rope_scaling, device, dtype
        )

    def layer(self, i: int) -> DecoderLayer:
        layer = self.layers[i]
        assert isinstance(layer, DecoderLayer)
        return layer

    @torch.inference_mode()
    def hidden(
        self,
        input_ids: torch.Tensor,
        pool: torch.Tensor,
        meta: Meta,
        backend: AttentionBackend[Meta],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (T,) -> final-normed hidden states (N, hidden) of ``rows`` (all T if None).

        The vocabulary projection is ``logits``'s, apart: on CUDA it runs outside the decode
        graphs, whose outputs stay allocated per batch-size bucket.
        """
        residual = self.embed(input_ids)  # (T, hidden)
        h = backend.rmsnorm(residual, self.layer(0).input_norm)
        fused = backend.decode_layers(self, h, residual, pool, meta)
        if fused is not None:  # the same kernels in one call (engine/model/fused_layers.py)
            return fused if rows is None else fused[rows]
        layers = [self.layer(i) for i in range(len(self.layers))]
        for i, layer in enumerate(layers):
            # NOTE: forward, not __call__ (no hooks here): a module call costs ~0.6 us.
            out = layer.attn.forward(h, pool, meta, backend)
            h = backend.rmsnorm(out, layer.post_attn_norm, residual=residual)
            out = layer.mlp.forward(h, backend.silu_mul, backend.takes_kernel_dtype)
            norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            h = backend.rmsnorm(out, norm, residual=residual)
        return h if rows is None else h[rows]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> float32 logits (N, vocab)."""
        with torch.inference_mode():
            return self.lm_head(hidden).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        pool: torch.Tensor,
        meta: Meta,
        backend: AttentionBackend[Meta],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (T,) -> float32 logits (N, vocab) at ``rows`` (N of the T tokens).

        Only the rows that will be sampled go through the (large) vocabulary projection.
        """
        return self.logits(self.hidden(input_ids, pool, meta, backend, rows))
