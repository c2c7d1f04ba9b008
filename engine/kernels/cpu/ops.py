"""pdserve's CPU kernel library (this folder's C++, built by ``make setup`` into
``_kernels*.so``), loaded once a process, and its elementwise and attention ops.

The library registers ``torch.ops.pdserve``: ``int4_mm``, ``int4_gemm`` and
``int4_gemm_a8`` (the packed layers' products, chosen by ``engine/weights/int4_tiles.py``),
and the ops below, which the fused CPU backend (``engine/model/fused_cpu.py``) calls. Each
gives a row the same bits whatever the rows beside it and the threads. It loads on any
x86-64 CPU (every kernel carries its own target attributes), but runs only where the CPU
has AVX-512 BF16: ``load`` refuses elsewhere, and each getter then gives None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

ATTENTION_HEAD_SIZES = (64, 128)  # head sizes decode_attention and prefill_attention are built for


class CpuOpsUnavailable(RuntimeError):
    """pdserve's CPU kernel library cannot run here; the message says why."""


def library_path() -> Path | None:
    """The built library (``setup.py``'s ``engine.kernels.cpu._kernels``), or None."""
    found = sorted(Path(__file__).parent.glob("_kernels*.so"))
    return found[0] if found else None


@functools.cache
def load() -> None:
    """Load the library into ``torch.ops.pdserve``, once a process. Raises
    ``CpuOpsUnavailable`` where this CPU lacks AVX-512 BF16 or the library is not built."""
    if not torch.cpu._is_avx512_bf16_supported():
        raise CpuOpsUnavailable("this CPU has no AVX-512 BF16")
    path = library_path()
    if path is None:
        raise CpuOpsUnavailable("not built (make setup builds it)")
    torch.ops.load_library(str(path))


def op(name: str) -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pdserve.<name>``, or None where the library is not built or cannot run,
    or was built before the op was (a stale build: its callers take their other path)."""
    try:
        load()
        found: Callable[..., torch.Tensor] = getattr(torch.ops.pdserve, name)
    except (CpuOpsUnavailable, AttributeError, RuntimeError):
        return None
    return found


def silu_mul_op() -> Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None:
    """The one-pass ``silu(gate) * up`` (``elementwise.cpp``: (T, 2 I) float32 or bfloat16
    -> (T, I) in float32 or bfloat16), or None where it is not built or this CPU lacks
    AVX-512 BF16. Within 6e-7 relative of torch's ``silu`` then ``mul`` (4.4e-7 the worst
    over 84M random values); elementwise, so a row's bits do not depend on the rows beside
    it."""
    return op("silu_mul")


def rope_store_op() -> Callable[..., torch.Tensor] | None:
    """Rotary + K/V store in one pass (``elementwise.cpp: rope_store``): (T, (H + 2 KVH) D)
    float32 or bfloat16 q | k | v, positions, the (P, D) float32 cos | sin table, one
    layer's K and V views of a pool in the attention library's ``vec16`` order, the slots
    -> rotated q (T, H, D) in the pool's dtype, with K and V written. Bit for bit what the
    library's ``rotary_embedding`` then ``cpu_attn_reshape_and_cache`` give. None where not
    built or without AVX-512 BF16."""
    return op("rope_store")


def decode_attention_op() -> Callable[..., torch.Tensor] | None:
    """Decode attention over a pool in the ``vec16`` order (``decode_attention.cpp``): q
    (B, H, D) in the cache's dtype, one layer's K and V views (as ``rope_store``'s), int32
    block tables (S, W), each row's int32 context length (B,), the scale, and optionally
    int32 query starts (S + 1,): sequence s's rows are ``[q_starts[s], q_starts[s + 1])``
    (by default one row a sequence) -> (B, H, D) in the cache's dtype. Each row attends over
    its own length as a decode step of that length would, to the same bits; a sequence's
    rows (a speculative verification's k + 1) run together on one core, each chunk of the
    context read once for all of them. In a bfloat16 pool both products are bfloat16
    pair-dots summed in float32, the probabilities rounded to bfloat16 (as the prefill
    kernel's); a float32 pool's are float32. Head sizes ``ATTENTION_HEAD_SIZES``, up to
    8 query heads a KV head. A last ``prefetch`` argument (1: into L1, 0: into L2; default
    -1, this CPU's choice) sets where the context is prefetched, to measure one against the
    other (``benchmarks.engine.kv_prefetch_ab``); the bits do not depend on it. None where
    not built or without AVX-512 BF16."""
    return op("decode_attention")


def prefill_attention_op() -> Callable[..., torch.Tensor] | None:
    """Causal attention of any query rows over a bfloat16 pool in the ``vec16`` order
    (``prefill_attention.cpp``): q (T, H, D) bfloat16, one layer's K and V views (as
    ``rope_store``'s), int32 query starts (B + 1,), context lengths (B,) and block tables
    (B, W), the scale -> (T, H, D) bfloat16; sequence b's query rows are the last of its
    context. Head sizes ``ATTENTION_HEAD_SIZES``, up to 8 query heads a KV head. None where
    not built or without AVX-512 BF16."""
    return op("prefill_attention")


def decode_layers_op() -> Callable[..., torch.Tensor] | None:
    """A decode step's decoder layers in one call (``decode_layers.cpp``; its arguments are
    described there, and ``engine/model/fused_layers.py`` gathers them), or None where not
    built, or built before the op was (a stale build runs the layers one by one)."""
    return op("decode_layers")


def refine_near_logits_op() -> Callable[..., torch.Tensor] | None:
    """The LM head's near logits recomputed in place (``near_logits.cpp``: out (T, V),
    x (T, K) float32, the head's int8 codes (V, K) and scales (V, K / 32), bias or None,
    margin in bfloat16 steps, most refined a row), or None where not built (or built
    before the op was) or this CPU lacks AVX-512 BF16."""
    return op("refine_near_logits")


def bind_threads_op() -> Callable[[list[int]], int] | None:
    """OpenMP team thread t onto ``cores[t]`` alone (``common.cpp``; torch's thread count
    must be at least ``len(cores)``) -> how many threads took their core; or None where
    the library is not built or cannot run here (then only the main thread is placed)."""
    return op("bind_threads")  # type: ignore[return-value]
