"""The attention backend: what one forward asks of the device besides its GEMMs.

The decoder has one layer loop (``engine/model/causal_lm.py``) on every device. What
differs between devices sits behind this interface: how a layer's new K/V are rotated and
stored and how it attends over the paged pool, and the small row-wise ops between the
GEMMs (add + RMSNorm, SiLU * up), which a backend may fuse.

* ``TorchBackend`` (``engine/model/torch_backend.py``): torch ops and SDPA
  (``engine/model/attention.py``); every device, and the reference the others are tested
  against; the fused CPU backend (``engine/model/fused_cpu.py``) builds on it;
* ``TritonBackend`` (``engine/cuda/kernels/backend.py``): rotary + KV store in one kernel,
  attention that reads the pool in place, fused add + RMSNorm and SiLU * up.

Who calls what: each backend builds one step's metadata in its own type
(``TorchBackend.prepare_metadata``: ``AttentionMetadata``; the Triton path's
``KernelPath``: ``KernelBatch``), and the runner calls
``CausalLM.hidden(ids, pool, meta, backend)``; the model calls the backend per layer. No
method syncs with the host unless its backend says so (Triton's never do: decode forwards
are captured in CUDA graphs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Protocol, TypeVar

import torch

from engine.model.layers import RMSNorm

Meta = TypeVar("Meta")


class AttentionLayer(Protocol):
    """What a backend reads of a layer's attention (``engine.model.causal_lm.SelfAttention``)."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int
    kv_size: int
    q_norm: RMSNorm | None

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class AttentionBackend(ABC, Generic[Meta]):
    # The order of the bytes inside a pool block that ``attend`` writes and reads
    # (``wire.kv_layout.KVLayout.order``): KV tiers and handoffs never mix orders.
    kv_order = "tokens"
    # Whether ``attend`` and ``silu_mul`` take the projections in their kernels' compute
    # dtype (``Linear.native``: bfloat16 from packed kernels under float32 activations),
    # widening what they compute in float32 themselves, with the same values as from
    # projections cast to the activations' dtype.
    takes_kernel_dtype = False
    # Whether ``attend`` finds a token's slot and rotation from ``positions`` and the block
    # tables alone, so its metadata holds slots instead of the torch backend's per-layer
    # write rows and rotary lookups (``AttentionMetadata.write_rows``, ``cos_sin``).
    paged_in_place = False

    def prepare(self, meta: Meta, pool: torch.Tensor, num_heads: int) -> Meta:
        """Once per step, before the layers: ``meta`` with whatever this backend derives
        from it for every layer (nothing, unless a backend says so)."""
        return meta

    def decode_layers(
        self,
        model: Any,
        h: torch.Tensor,
        residual: torch.Tensor,
        pool: torch.Tensor,
        meta: Meta,
    ) -> torch.Tensor | None:
        """Every decoder layer of ``model`` in one call where this backend has one for the
        step (``FusedCpuBackend``): ``h`` the first layer's normed input, ``residual`` the
        stream (updated in place) -> the final norm's output, as the layer loop of
        ``CausalLM.hidden`` gives it. None: run that loop."""
        return None

    @abstractmethod
    def attend(
        self, attn: AttentionLayer, qkv: torch.Tensor, pool: torch.Tensor, meta: Meta
    ) -> torch.Tensor:
        """One layer's attention: ``qkv`` (T, q_size + 2 * kv_size), the projection of the
        step's T new tokens -> (T, q_size). Rotates q and k by the tokens' positions (after
        Qwen3's per-head norms, ``attn.split``), writes k and v into ``pool`` at the tokens'
        slots for layer ``attn.layer``, and attends over each sequence's whole context."""

    @abstractmethod
    def rmsnorm(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``norm(x)`` for x (T, N); with ``residual`` (T, N): first ``residual += x`` in
        place (the skip connection, rounded to the model dtype), then ``norm(residual)``."""

    @abstractmethod
    def silu_mul(
        self, gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """(T, 2 * inter) gate columns then up columns -> silu(gate) * up, (T, inter),
        computed in ``dtype`` (the activations'), returned rounded to ``out_dtype`` (None:
        ``dtype``; the down projection's input dtype, which would round it anyway)."""
