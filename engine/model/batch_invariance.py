"""Batch-invariant (deterministic) inference: a request's bits do not depend on its steps.

With ``EngineConfig.deterministic`` (``launch --enable-deterministic-inference``, or
``VLLM_BATCH_INVARIANT=1`` in the launcher's environment: ``launcher/args.py``) every row of a forward is
computed by arithmetic chosen per row, never by the shape of the step it shares:

* packed layers (``Int4Kernel``, ``Int8Kernel``): decode steps and speculative
  verifications run the packed kernel at every row count (by default the bfloat16 GEMM
  from a row count measured at load); prefill forwards run the GEMM at every row count,
  as by default (by phase). The LM head, which by default went by rows in prefill too,
  runs the packed kernel always;
* the LM head's refined logits (``RefinedHead``): each near logit a product summed on
  its own, not one batched product whose sums move with the batch's rows and its widest
  near count;
* dense layers: GEMM calls of ``ROW_TILE`` rows (``engine/weights/row_tiles.py``);
* attention on the torch reference backend: every row attends over exactly its own
  context, one SDPA call per row in the cache's dtype at one thread (the kernel's sums
  move with the thread count, which the core lease changes per step), a prefill row as a
  decode row would (``invariant_meta``), so a prompt's KV does not depend on its batch,
  its chunking, a prefix-cache hit or the threads, and equals what decode steps would
  have written;
* pdserve's fused CPU attentions already give a row its own bits (both kernels); where
  they do not take a pool (float32 KV, another head size) the torch reference runs;
* co-located workers never mix prompt chunks and decode rows in one forward.

Already per row and left as they are: the packed kernel, each GEMM taken alone, norms,
rotary, SiLU * up, sampling (a seeded request's token at output position ``p`` depends
only on (seed, p, logits)).

Not covered: CUDA (refused: ``DeterminismUnsupported``), LoRA adapters. On packed
weights (and the fused attentions) a prompt's rows and generated rows keep different
arithmetic (``decode_kv_equals_prefill``): there blocks that decode steps fill are not
published to the prefix cache (a later prompt holding those tokens gets a prefill's KV,
cached or not), and KV recomputed for generated tokens (a request resumed on another
worker, or preempted for KV space) is not bitwise what decode wrote.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.model.attention import AttentionMetadata
from engine.weights.gemm import NEVER
from engine.weights.linear import DenseKernel, Int4Kernel, Int8Kernel, Linear
from engine.weights.refined_head import RefinedHead
from engine.weights.row_tiles import ROW_TILE


class DeterminismUnsupported(ValueError):
    """Deterministic inference was asked for where it is not implemented."""


def check_device(device: torch.device) -> None:
    if device.type != "cpu":
        raise DeterminismUnsupported(
            f"deterministic inference runs on CPU only for now, not on {device}"
        )


def make_batch_invariant(model: nn.Module) -> dict[str, int]:
    """Switch every linear layer of a loaded ``model`` to its per-row arithmetic; returns
    how many layers of each kind changed."""
    changed = {"packed": 0, "dense": 0, "head": 0}
    for module in model.modules():
        if not isinstance(module, Linear) or module.kernel is None:
            continue
        kernel: object = module.kernel
        if isinstance(kernel, RefinedHead):
            kernel.row_invariant = True
            changed["head"] += 1
            kernel = kernel.packed
        if isinstance(kernel, Int4Kernel | Int8Kernel):
            if kernel.many_rows is not None:
                # Prefill forwards keep the GEMM (``by_phase``); every other call of any
                # row count runs the packed kernel.
                kernel.many_rows.min_rows = NEVER
            changed["packed"] += 1
        elif isinstance(kernel, DenseKernel):
            kernel.row_tile = ROW_TILE
            changed["dense"] += 1
    return changed


def decode_kv_equals_prefill(model: nn.Module, backend: object) -> bool:
    """Whether a batch-invariant ``model`` writes the same KV for a token in a decode step
    as in a prefill: not where packed layers hold a GEMM for prefill, nor on the fused
    attentions (one kernel each, per row but not the same arithmetic)."""
    if getattr(backend, "paged_in_place", False):
        return False
    for module in model.modules():
        kernel = module.kernel if isinstance(module, Linear) else None
        if isinstance(kernel, Int4Kernel | Int8Kernel) and kernel.many_rows is not None:
            return False
    return True


def fused_attention_invariant(
    backend: object, kv_dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether ``backend`` attends with per-row kernels at every step: the torch reference
    (made so by ``invariant_meta``), or the fused CPU backend where pdserve's decode and
    prefill attentions both take the pool (not the library's, whose work split follows
    the batch)."""
    takes = getattr(backend, "_takes", None)
    if takes is None:
        return True
    pool = torch.empty(0, 0, 0, 0, kv_heads, head_dim, dtype=kv_dtype)  # shape and dtype only
    return bool(takes("decode", pool, num_heads) and takes("prefill", pool, num_heads))


def invariant_meta(meta: AttentionMetadata) -> AttentionMetadata:
    """The torch reference backend's metadata with every row attending alone over its own
    context: decode rows each in an SDPA call of their own width, prefill rows as decode
    rows (``_decode_rows_attention``), whatever else the step holds; those calls at one
    thread, whatever the worker's core lease granted the step."""
    every = frozenset(range(len(meta.q_lens)))
    as_decode = not meta.is_decode or meta.rows_as_decode
    return replace(meta, exact_rows=every, rows_as_decode=as_decode, exact_one_thread=True)
