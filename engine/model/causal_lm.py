"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV pool.

The model knows tokens, positions and attention metadata, nothing about requests. The
per-architecture differences are two flags of ``ModelConfig``: ``qkv_bias`` (Qwen2) and
``qk_norm`` (Qwen3: RMSNorm over each head of q and k, before rotary).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.weights.linear import Embedding, Linear


class SelfAttention(nn.Module):
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

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)  # (T, q_size + 2 * kv_size)
        h, d = self.num_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size :].unflatten(1, (self.num_kv_heads, d))
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.unflatten(1, (h, d))), *cos_sin)
            k = apply_rotary(self.k_norm(k.unflatten(1, (self.num_kv_heads, d))), *cos_sin)
        else:  # q and k heads side by side: one rotation for both (T, heads + kv_heads, D)
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].unflatten(1, (-1, d)), *cos_sin)
            q, k = qk[:, :h], qk[:, h:]
        out = paged_attention(pool, self.layer, meta, q, k, v)  # (T, heads, D)
        return self.o(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(
        self, m: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.input_norm = RMSNorm(m.hidden_size, m.rms_norm_eps, dtype, device)
        self.attn: SelfAttention = SelfAttention(m, layer, dtype, device)
        self.post_attn_norm = RMSNorm(m.hidden_size, m.rms_norm_eps, dtype, device)
        self.mlp: GatedMLP = GatedMLP(m.hidden_size, m.intermediate_size, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos_sin, pool, meta)
        return x + self.mlp(self.post_attn_norm(x))


class CausalLM(nn.Module):
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
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: (T,); logits_indices: (N,) -> float32 logits (N, vocab)."""
        x = self.embed(input_ids)  # (T, hidden)
        cos_sin = self.rotary.lookup(positions)
        for layer in self.layers:
            x = layer(x, cos_sin, pool, meta)
        # Only the rows that will be sampled go through the (large) vocabulary projection.
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()
