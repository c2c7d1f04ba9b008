"""Batch-invariant (deterministic) inference: a request's bits do not depend on its steps.

With ``EngineConfig.deterministic`` (``launch --enable-deterministic-inference``, or
``VLLM_BATCH_INVARIANT=1`` in the launcher's environment: ``launcher/args.py``) every row of a forward is
computed by arithmetic chosen per row, never by the shape of the step it shares:

* packed layers (``Int4Kernel``, ``Int8Kernel``) and the LM head: the packed kernel at
  every row count, in every phase (by default the bfloat16 GEMM takes prefills and decode
  steps from a row count measured at load). The kernel gives a row the same bits in any
  batch, so a prompt's rows and a decode step's run the same arithmetic;
* the LM head's refined logits (``RefinedHead``): each near logit a product summed on
  its own, not one batched product whose sums move with the batch's rows and its widest
  near count;
* dense layers: GEMM calls of ``ROW_TILE`` rows (``engine/weights/row_tiles.py``);
* attention: every row attends over exactly its own context as a decode row of that
  length would, a prompt's rows too. On pdserve's fused CPU attentions that is the decode
  kernel for every row (``rows_as_decode``: a sequence's rows in turn on one core); on the
  torch reference backend one SDPA call per row in the cache's dtype at one thread (the
  kernel's sums move with the thread count, which the core lease changes per step:
  ``invariant_meta``). Where the fused attentions do not take a pool (float32 KV,
  another head size) the torch reference runs;
* co-located workers never mix prompt chunks and decode rows in one forward.

So a token's KV is the same bits whether a prefill or a decode step wrote it, whatever
the batch, its chunking, a prefix-cache hit or the threads: blocks decode steps fill are
published to the prefix cache, and KV recomputed for generated tokens (a request resumed
on another worker, or preempted for KV space) is what decode wrote.

Already per row and left as they are: each GEMM taken alone, norms, rotary, SiLU * up,
sampling (a seeded request's token at output position ``p`` depends only on (seed, p,
logits)).

Not covered: CUDA (refused: ``DeterminismUnsupported``), LoRA adapters.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.model.attention import AttentionMetadata
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
            kernel.per_row()  # every call, of any phase and rows: the packed kernel
            changed["packed"] += 1
        elif isinstance(kernel, DenseKernel):
            kernel.row_tile = ROW_TILE
            changed["dense"] += 1
    return changed


def fused_attention_invariant(
    backend: object, kv_dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether ``backend`` attends with per-row kernels at every step: the torch reference
    (made so by ``invariant_meta``), or the fused CPU backend where pdserve's decode
    attention takes the pool (every row then runs it; not the library's kernel, whose work
    split follows the batch)."""
    takes = getattr(backend, "_takes", None)
    if takes is None:
        return True
    pool = torch.empty(0, 0, 0, 0, kv_heads, head_dim, dtype=kv_dtype)  # shape and dtype only
    return bool(takes("decode", pool, num_heads))


def invariant_meta(meta: AttentionMetadata) -> AttentionMetadata:
    """The torch reference backend's metadata with every row attending alone over its own
    context: decode rows each in an SDPA call of their own width, prefill rows as decode
    rows (``_decode_rows_attention``), whatever else the step holds; those calls at one
    thread, whatever the worker's core lease granted the step."""
    every = frozenset(range(len(meta.q_lens)))
    as_decode = not meta.is_decode or meta.rows_as_decode
    return replace(meta, exact_rows=every, rows_as_decode=as_decode, exact_one_thread=True)
