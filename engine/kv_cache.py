"""The paged KV pool: one tensor, block-major, so one block is one contiguous byte range.

Layout ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``; index 0 of
the third axis is K, 1 is V. Token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at slot ``t % block_size``, for every layer. Because a
block holds all layers, the transport moves a request's KV by copying whole blocks.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


def kv_pool_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    m = model_config
    return (num_blocks, m.num_layers, 2, block_size, m.num_kv_heads, m.head_dim)


def block_nbytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the pool (all layers, K and V)."""
    per_block = 1
    for dim in kv_pool_shape(model_config, 1, block_size):
        per_block *= dim
    return per_block * torch.empty((), dtype=dtype).element_size()


def allocate_kv_pool(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    # Zeros, not empty: padded attention reads (and masks) slots no token wrote yet, and
    # masked garbage that happens to be NaN would still poison the weighted sum.
    return torch.zeros(
        kv_pool_shape(model_config, num_blocks, block_size), dtype=dtype, device=device
    )


def check_kv_pool(pool: torch.Tensor, model_config: ModelConfig, block_size: int) -> int:
    """Validate an externally allocated pool; returns its number of blocks."""
    expected = kv_pool_shape(model_config, pool.shape[0], block_size)
    if tuple(pool.shape) != expected:
        raise ValueError(f"kv_pool has shape {tuple(pool.shape)}, expected {expected}")
    if not pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous (blocks are copied as byte ranges)")
    return int(pool.shape[0])
