"""The fused CPU attention backend: the kernel library's ops (``engine/kernels/vllm_cpu.py``)
around the GEMMs, and its attention straight over the paged pool.

Per layer, around the GEMMs, the torch backend runs ~35 small eager ops (the norms' float
casts and reductions, rotary's cat/neg/mul/add, casts and index copies of K and V into the
pool and into a dense copy of the batch's context, SDPA over that copy); at 1-32 decode
rows each costs a few microseconds of dispatch, most of a step's time outside its math.
Here, per layer:

* add + RMSNorm: ``fused_add_rms_norm`` (the residual sum, then its norm, one pass);
* rotary + K/V store: pdserve's one-pass ``rope_store`` where it is built
  (``engine/kernels/cpu/ops.py``): it reads the projection in its kernel's dtype
  (``takes_kernel_dtype``), rotates q and k in float32, and writes q in the cache's dtype
  and K and V into their slots, bit for bit what the library's four steps give: widen
  qkv, ``rotary_embedding`` over q and k, round qkv to the cache's dtype,
  ``cpu_attn_reshape_and_cache`` (the path kept for Qwen3's per-head norms and AVX2);
* attention: straight over each sequence's blocks in the pool, with no dense copy of the
  batch's K/V. Steps whose rows attend as decode rows (decode, and speculative
  verifications, each of whose k + 1 rows attends over its own length of the context as
  its decode step would) take pdserve's ``decode_attention`` where it is built
  (``ops.decode_attention_op``): a sequence's query heads share each K and V load,
  its rows run one after another on one core (the context read from memory once, then from
  L2), a row's bits independent of its batch: a step's attention in 0.84-0.86x the
  library's time at 8-32 rows of 300 tokens (1.03x at one), and served at 16 streams of
  1.5k-token contexts ITL p50 0.74x (``benchmarks/results/fused_ops.md``). Other steps
  (prefill, chunked prefill, mixed) on a bfloat16 pool take pdserve's
  ``prefill_attention`` (``ops.prefill_attention_op``): causal over a sequence's
  whole context, both products as bfloat16 pair-dots on K and V re-laid once per 32 tokens
  for all of a task's rows, a row's bits independent of its batch and of how its prompt
  was chunked; 0.48x the library's time for prompts of 256-2048 tokens. The rest (a
  float32 pool) take the library's ``cpu_attention_with_kv_cache``;
* SiLU * up: pdserve's own one-pass kernel where it is built (``ops.silu_mul_op``;
  2-2.5x faster than torch's ``silu`` then ``mul_`` at 1-256 rows on a Zen 5, and it reads
  a bfloat16 gate_up projection without widening it first), else torch's: the library's
  ``silu_and_mul`` measured 1.2-5x slower than torch's at 1-256 rows
  (``benchmarks/results/fused_ops.md``), while its add + RMSNorm took 0.2-0.36x and its
  rotary 0.16-0.19x of torch's time.

NOTE: the pool's layout inside a block is the library's, not the torch backend's. A block
of one layer's K (or V) is still one contiguous chunk of ``block_size * KVH * D`` values
at the same place (``(num_blocks, L, 2, chunk)``), so the allocator, prefix cache, tiers
and KV handoff, which move whole blocks, do not change; but inside the chunk the library
lays K out its own way (transposed for its dot products) and V as (KVH, block_size, D).
Every worker of one deployment runs the same backend (one ``--attention-backend``), and
the ``vec16`` kernels' layout is the same on every x86-64 build (AVX2, AVX-512, AMX), so
a handoff between them is consistent. A torch-backend worker cannot read such a pool.

Equal to ``TorchBackend`` within rounding (``tests/engine/test_fused_cpu.py`` states the
tolerances): the kernels compute in float32 inside and round once; attention computes in
the cache's dtype, as the torch backend's decode does (its prefill: in the activations').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.kernels.cpu.ops import (
    ATTENTION_HEAD_SIZES,
    decode_attention_op,
    decode_layers_op,
    prefill_attention_op,
    rope_store_op,
    silu_mul_op,
)
from engine.kernels.vllm_cpu import CpuKernels, available
from engine.model.attention import AttentionMetadata
from engine.model.backend import AttentionLayer
from engine.model.fused_layers import LayerStack, layer_stack
from engine.model.layers import RMSNorm
from engine.model.torch_backend import PagedSequence, TorchBackend, TorchGeometry

# The library's portable kernel family: its K layout does not depend on the CPU's ISA
# (the "amx" family packs K differently), and it takes blocks of 16 tokens (``vec``: 32).
ISA = "vec16"
BLOCK_ALIGNMENT = 16
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what pdserve's kernels read and write


@dataclass(frozen=True)
class PagedBatch:
    """One step's inputs to the library's store and attention. B requests (a verification
    on the library's kernel runs each query row as a request of its own), T tokens, int32
    unless said; ``seq_lens`` is per query row where ``kernel`` is "decode"."""

    slots: torch.Tensor  # (T,) int64: block * block_size + offset of each new token
    q_starts: torch.Tensor  # (B + 1,) request b's query rows are [q_starts[b], q_starts[b + 1])
    # (B,) context length, the request's new tokens included ("decode": (T,), each query
    # row's own, as a decode step of that row would see it)
    seq_lens: torch.Tensor
    block_tables: torch.Tensor  # (B, W) pool blocks of each request
    # Whose attention takes the step (``FusedCpuBackend.prepare``): pdserve's "decode" (one
    # query row a request), pdserve's "prefill" (any rows, a bfloat16 pool), or the
    # "library"'s, with its work split for these shapes (opaque) in ``schedule``.
    kernel: str
    schedule: torch.Tensor | None = None


class FusedCpuBackend(TorchBackend):
    """Library kernels for add + RMSNorm, rotary, the K/V store and attention over the paged
    pool (CPU only); SiLU * up is pdserve's kernel, or the torch backend's."""

    kv_order = ISA  # the library's order inside a block: tiers and handoffs keep it apart
    takes_kernel_dtype = True
    paged_in_place = True

    def __init__(self, kernels: CpuKernels, geometry: TorchGeometry) -> None:
        super().__init__(geometry)  # no dense K/V: attention reads the pool in place
        rotary = geometry.rotary
        self.kernels = kernels
        self._ops = torch.ops._C
        self._silu_mul = silu_mul_op()
        # Its tables in float32 (a float32 model's): rotary in a bfloat16 model rounds q and
        # k to bfloat16 before the cache's dtype, which the library's path keeps doing. Its
        # head size in whole vectors of 16 pairs.
        fits = rotary.cos.dtype == torch.float32 and rotary.cos.shape[1] % 32 == 0
        self._rope_store = rope_store_op() if fits else None
        self._decode_attention = decode_attention_op()
        self._prefill_attention = prefill_attention_op()
        half = rotary.cos.shape[1] // 2
        # (P, D): cos then sin of each position's D / 2 frequencies (the halves of
        # RotaryEmbedding's tables are equal), the layout rotary_embedding reads.
        self.cos_sin = torch.cat((rotary.cos[:, :half], rotary.sin[:, :half]), dim=1).contiguous()
        self._caches: dict[
            tuple[int, tuple[int, ...]], list[tuple[torch.Tensor, torch.Tensor]]
        ] = {}
        # A decode step's layers in one call; None runs them one by one (a build without the
        # op; benchmarks and tests set it to set the loop against the call).
        self.decode_layers_op = decode_layers_op()
        self._stack: tuple[int, LayerStack | None] | None = None  # (id of the model, its stack)

    def _placement(
        self, positions: list[int], pos: torch.Tensor, slot_blocks: list[int]
    ) -> dict[str, Any]:
        """Each new token's slot, block * block_size + offset: the store and the rotation
        find the rest from ``positions``."""
        bs = self.geometry.block_size
        slots = [b * bs + p % bs for b, p in zip(slot_blocks, positions, strict=True)]
        return {"slots": torch.tensor(slots, dtype=torch.long, device=self.geometry.device)}

    def _decode_fields(
        self,
        spans: Sequence[tuple[PagedSequence, int, int]],
        block_tables: torch.Tensor,
        ctx_lens: list[int],
        pool: torch.Tensor,
    ) -> dict[str, Any]:
        return {}  # decode attention reads the pool in place: no bias, no gathered rows

    def prepare(
        self, meta: AttentionMetadata, pool: torch.Tensor, num_heads: int
    ) -> AttentionMetadata:
        """``meta`` with the step's ``PagedBatch``, computed once for all layers."""
        assert meta.positions is not None and meta.slots is not None, "_metadata sets them"
        kv_heads, d = pool.shape[4], pool.shape[5]
        # From the host's lists, not tensor ops: at 1-32 rows a step, each op's dispatch
        # costs more than its arithmetic.
        starts = [0]
        for n in meta.q_lens:
            starts.append(starts[-1] + n)
        tables = meta.block_tables.to(torch.int32)
        if meta.rows_as_decode or starts[-1] == len(starts) - 1:
            # Every query row attends as a decode step of its own length would (a decode
            # step; a verification's rows, which see what their decode steps would).
            spans = list(zip(meta.ctx_lens, meta.q_lens, strict=True))
            lens = [p + 1 for c, n in spans for p in range(c - n, c)]
            if self._takes("decode", pool, num_heads):  # a sequence's rows read it in turn
                paged = PagedBatch(
                    meta.slots,
                    torch.tensor(starts, dtype=torch.int32),
                    torch.tensor(lens, dtype=torch.int32),
                    tables.contiguous(),
                    "decode",
                )
                return replace(meta, paged=paged)
            # The library's kernel: each row a request of its own.
            tables = tables[[i for i, (_, n) in enumerate(spans) for _ in range(n)]]
            starts = list(range(len(lens) + 1))
        else:
            lens = list(meta.ctx_lens)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q_starts = torch.tensor(starts, dtype=torch.int32)
        if self._takes("prefill", pool, num_heads):
            paged = PagedBatch(meta.slots, q_starts, seq_lens, tables.contiguous(), "prefill")
            return replace(meta, paged=paged)
        schedule = self._ops.get_scheduler_metadata(
            len(seq_lens),
            num_heads,
            kv_heads,
            d,
            seq_lens,
            pool.dtype,
            q_starts,
            True,
            -1,
            ISA,
            False,
            None,
        )
        paged = PagedBatch(meta.slots, q_starts, seq_lens, tables, "library", schedule)
        return replace(meta, paged=paged)

    def _takes(self, kernel: str, pool: torch.Tensor, num_heads: int) -> bool:
        """Whether pdserve's ``kernel`` attention ("decode": one-row-a-request steps,
        "prefill": any other) is built and takes this pool's heads and dtype (the prefill
        kernel bfloat16 only: its products are bfloat16 pair-dots)."""
        kv_heads, d = pool.shape[4], pool.shape[5]
        op, dtypes = (
            (self._decode_attention, _KERNEL_DTYPES)
            if kernel == "decode"
            else (self._prefill_attention, (torch.bfloat16,))
        )
        return (
            op is not None
            and d in ATTENTION_HEAD_SIZES
            and num_heads % kv_heads == 0
            and num_heads // kv_heads <= 8
            and pool.dtype in dtypes
        )

    def attend(
        self, attn: AttentionLayer, qkv: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        paged = meta.paged
        assert isinstance(paged, PagedBatch), "FusedCpuBackend.prepare makes the step's batch"
        t, h, kvh, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        key_cache, value_cache = self._layer_caches(pool)[attn.layer]
        if (
            self._rope_store is not None
            and attn.q_norm is None
            and qkv.dtype in _KERNEL_DTYPES
            and pool.dtype in _KERNEL_DTYPES
            and qkv.stride(1) == 1
        ):
            # The four steps below in one pass, to the same bits (``rope_store``).
            query = self._rope_store(
                qkv, meta.positions, self.cos_sin, key_cache, value_cache, paged.slots, h, kvh
            )
        else:
            query = self._rope_then_store(attn, qkv, pool, meta, key_cache, value_cache)
        if paged.kernel != "library":  # pdserve's kernels (``prepare`` chose)
            q = query.to(pool.dtype).contiguous()
            if paged.kernel == "decode":  # one row a request
                assert self._decode_attention is not None
                out = self._decode_attention(
                    q,
                    key_cache,
                    value_cache,
                    paged.block_tables,
                    paged.seq_lens,
                    d**-0.5,
                    paged.q_starts,
                )
            else:
                assert self._prefill_attention is not None
                out = self._prefill_attention(
                    q,
                    key_cache,
                    value_cache,
                    paged.q_starts,
                    paged.seq_lens,
                    paged.block_tables,
                    d**-0.5,
                )
            return out.view(t, attn.q_size)
        out = torch.empty(t, h, d, dtype=pool.dtype)
        self._ops.cpu_attention_with_kv_cache(
            query,
            key_cache,
            value_cache,
            out,
            paged.q_starts,
            paged.seq_lens,
            d**-0.5,
            True,
            None,
            -1,
            paged.block_tables,
            0.0,
            paged.schedule,
            None,
            None,
        )
        return out.view(t, attn.q_size)  # in the cache's dtype: the output projection casts

    def decode_layers(
        self,
        model: Any,
        h: torch.Tensor,
        residual: torch.Tensor,
        pool: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """A step whose rows attend as decode rows, on pdserve's rotary + store and decode
        attention, of a model all on the int4 kernel: its layers in one call
        (``engine/model/fused_layers.py``)."""
        paged = meta.paged
        if (
            self.decode_layers_op is None
            or self._rope_store is None
            or not isinstance(paged, PagedBatch)
            or paged.kernel != "decode"
            or h.dtype != torch.float32
            or pool.dtype not in _KERNEL_DTYPES
        ):
            return None
        if self._stack is None or self._stack[0] != id(model):
            self._stack = (id(model), layer_stack(model))
        stack = self._stack[1]
        if stack is None or not stack.packed_at(h):
            return None
        caches = [view for pair in self._layer_caches(pool) for view in pair]
        return self.decode_layers_op(
            h,
            residual,
            stack.tiles,
            stack.outs,
            stack.norms,
            stack.eps,
            meta.positions,
            self.cos_sin,
            caches,
            paged.slots,
            paged.block_tables,
            paged.seq_lens,
            paged.q_starts,
            stack.num_heads,
            stack.num_kv_heads,
            stack.head_dim**-0.5,
            stack.amx,
            stack.planes,
            stack.a8,
        )

    def _rope_then_store(
        self,
        attn: AttentionLayer,
        qkv: torch.Tensor,
        pool: torch.Tensor,
        meta: AttentionMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The library's rotary and K/V store, for what ``rope_store`` does not take
        (Qwen3's per-head norms, other dtypes): q (T, H, D) in the cache's dtype."""
        paged = meta.paged
        assert isinstance(paged, PagedBatch)
        t, h, kvh, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_size, qk_size = attn.q_size, attn.q_size + attn.kv_size
        # Rotary runs in the model's dtype (its tables'): qkv may come narrower, straight
        # from a packed kernel (``takes_kernel_dtype``); q and k are widened first.
        cos_sin = self.cos_sin
        if attn.q_norm is None:
            # (T, q_size + 2 kv_size): q, k, then v of each token; fresh from the
            # projection, so rotated in place below.
            qkv = qkv if qkv.dtype == cos_sin.dtype else qkv.to(cos_sin.dtype)
        else:  # Qwen3: per-head norms first (in the model's dtype), into a fresh q | k | v
            q3, k3, v3 = attn.split(qkv.to(cos_sin.dtype))
            qkv = torch.cat((q3.flatten(1), k3.flatten(1), v3.flatten(1)), dim=1)
        # In place: q (T, q_size) and k (T, kv_size) are strided row views of qkv.
        self._ops.rotary_embedding(
            meta.positions, qkv[:, :q_size], qkv[:, q_size:qk_size], d, cos_sin, True
        )
        # The library stores and attends in the cache's dtype: q, K and V rounded to it, in
        # one cast (the store and the attention read strided rows).
        qkv = qkv.to(pool.dtype)
        self._ops.cpu_attn_reshape_and_cache(
            qkv[:, q_size:qk_size].view(t, kvh, d),
            qkv[:, qk_size:].view(t, kvh, d),
            key_cache,
            value_cache,
            paged.slots,
            ISA,
        )
        return qkv[:, :q_size].view(t, h, d)

    def _layer_caches(self, pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the library's (num_blocks, KVH, block_size, D) views of its K and V
        chunks in ``pool`` (num_blocks, L, 2, block_size, KVH, D), made once per pool."""
        key = (pool.data_ptr(), tuple(pool.shape))
        if (views := self._caches.get(key)) is None:
            nb, layers, _, bs, kv_heads, d = pool.shape
            chunk = bs * kv_heads * d
            assert pool.is_contiguous() and bs % BLOCK_ALIGNMENT == 0, (pool.stride(), bs)
            shape, strides = (nb, kv_heads, bs, d), (layers * 2 * chunk, bs * d, d, 1)
            base = pool.storage_offset()
            views = [
                (
                    pool.as_strided(shape, strides, base + 2 * layer * chunk),
                    pool.as_strided(shape, strides, base + (2 * layer + 1) * chunk),
                )
                for layer in range(layers)
            ]
            self._caches = {key: views}  # one pool per runner: keep only the newest
        return views

    def silu_mul(
        self, gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        out_dtype = out_dtype or dtype
        if self._silu_mul is None or dtype not in _KERNEL_DTYPES or out_dtype not in _KERNEL_DTYPES:
            return super().silu_mul(gate_up, dtype, out_dtype)
        # Computed in float32 and rounded once: a float32 model's result straight to
        # ``out_dtype`` (the down projection's bfloat16: a pass fewer, the bits of a cast),
        # a bfloat16 model's to bfloat16 first, as its activations are.
        out = self._silu_mul(gate_up, out_dtype if dtype == torch.float32 else dtype)
        return out if out.dtype == out_dtype else out.to(out_dtype)

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


def cpu_backend(attention_backend: str, geometry: TorchGeometry) -> TorchBackend:
    """The backend of a CPU engine: fused where ``attention_backend`` is ``auto``, the
    kernel library loads on this CPU and its attention takes the model's head size, the
    cache's dtype and the block size; else the torch reference with its dense decode K/V
    (``--attention-backend torch`` forces it)."""
    reference = TorchBackend(geometry, dense_decode=True)
    if attention_backend != "auto" or geometry.block_size % BLOCK_ALIGNMENT:
        return reference
    kernels = available()
    head_dim = geometry.rotary.cos.shape[1]
    if kernels is None or not _attention_takes(head_dim, geometry.kv_dtype):
        return reference
    return FusedCpuBackend(kernels, geometry)


def _attention_takes(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the library's attention has kernels for this head size and dtype (it has
    for the usual 64-256, not for the tiny test checkpoints' 16)."""
    one, starts = torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    try:
        torch.ops._C.get_scheduler_metadata(
            1, 1, 1, head_dim, one, dtype, starts, True, -1, ISA, False, None
        )
    except RuntimeError:
        return False
    return True
