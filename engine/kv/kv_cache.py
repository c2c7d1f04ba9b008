"""The paged KV pool: one tensor, block-major, so one block is one contiguous byte range.

Its layout is ``wire.kv_layout.KVLayout`` (``pool_layout`` builds it for a model):
``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``. Token ``t`` of a
sequence lives in block ``block_table[t // block_size]`` at slot ``t % block_size``, for
every layer. Because a block holds all layers, the transport moves a request's KV by
copying whole blocks.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

from engine.config import ModelConfig
from wire.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch


def pool_layout(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | str
) -> KVLayout:
    """The layout of a pool of ``num_blocks`` blocks for this model (``dtype`` a torch
    dtype or its name: the launcher plans without torch)."""
    m = model_config
    return KVLayout(
        num_blocks,
        m.num_layers,
        block_size,
        m.num_kv_heads,
        m.head_dim,
        dtype=str(dtype).removeprefix("torch."),
    )


def layout_of(pool: torch.Tensor, order: str = "tokens") -> KVLayout:
    """The layout of an existing pool tensor (``order``: its attention backend's ``kv_order``)."""
    n, layers, _, block, heads, dim = pool.shape
    dtype = str(pool.dtype).removeprefix("torch.")
    return KVLayout(n, layers, block, heads, dim, dtype=dtype, order=order)


def allocate_kv_pool(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A pool that reads as zeros.

    Zeros, not garbage: padded attention reads (and masks) slots no token wrote yet, and
    masked garbage that happens to be NaN would still poison the weighted sum. On CPU the
    pool is an anonymous mapping, whose pages are zero and committed only when first
    written: a large pool costs memory as it fills, not at startup. A private one: no
    other process maps the pool (handoffs copy blocks out), and a private page's first
    write faults ~1.5x faster than a shared one's (2.5 against 1.6 GB/s on the 2-core
    EPYC VM), which a prompt's first K/V stores and a restart's tier-3 loads pay.
    """
    import torch

    layout = pool_layout(model_config, num_blocks, block_size, dtype)
    if torch.device(device).type != "cpu":
        return torch.zeros(layout.shape, dtype=dtype, device=device)
    # NOTE: the tensor keeps the mmap object alive (torch.frombuffer holds the buffer).
    private = mmap.mmap(-1, layout.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(private, dtype=dtype).view(layout.shape)


def check_kv_pool(pool: torch.Tensor, model_config: ModelConfig, block_size: int) -> int:
    """Validate an externally allocated pool; returns its number of blocks."""
    expected = pool_layout(model_config, pool.shape[0], block_size, pool.dtype).shape
    if tuple(pool.shape) != expected:
        raise ValueError(f"kv_pool has shape {tuple(pool.shape)}, expected {expected}")
    if not pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous (blocks are copied as byte ranges)")
    return int(pool.shape[0])


class GpuMemoryError(MemoryError):
    """A worker's share of its GPU cannot hold the model, its activations and a KV cache."""


def kv_blocks_for_budget(
    total_bytes: int,
    share: float,
    used_bytes: int,
    peak_activation_bytes: int,
    block_nbytes: int,
) -> int:
    """KV blocks that fit in one worker's share of a GPU.

    ``share`` is this worker's fraction of the GPU's *total* memory (the launcher splits
    ``--gpu-memory-utilization`` evenly between the workers on one GPU), so the answer is
    the same whenever and in whatever order the workers on a GPU start. From that budget
    come first what the worker holds (``used_bytes``: weights), then the most its largest
    forward allocates beyond that (``peak_activation_bytes``, measured); the rest is KV.
    ``block_nbytes`` is what one block costs, including any per-block transient.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"GPU memory share must be in (0, 1], not {share}")
    if block_nbytes < 1 or used_bytes < 0 or peak_activation_bytes < 0:
        raise ValueError("block_nbytes must be >= 1 and memory sizes >= 0")
    budget = int(total_bytes * share)
    need = used_bytes + peak_activation_bytes
    where = f"this worker's {_gib(budget)} ({share:.1%} of the GPU's {_gib(total_bytes)})"
    if need >= budget:
        raise GpuMemoryError(
            f"the model needs {_gib(used_bytes)} for weights and {_gib(peak_activation_bytes)} "
            f"for activations, more than {where}: raise --gpu-memory-utilization, give the "
            f"worker a GPU of its own, or lower --chunked-prefill-size/--max-num-seqs"
        )
    blocks = (budget - need) // block_nbytes
    if blocks < 1:
        raise GpuMemoryError(
            f"{_gib(budget - need)} left for the KV cache in {where}, less than one block "
            f"({block_nbytes} bytes): raise --gpu-memory-utilization or lower --block-size"
        )
    return blocks


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
