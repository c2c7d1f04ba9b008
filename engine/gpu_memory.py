"""Sizing a GPU KV pool: this engine's share of its GPU, minus weights and activations.

Measured, not read from free memory: the weights are what this process has allocated, the
activations the peak of profiling forwards beyond that. Neither changes when other workers
start on the same GPU at the same moment, so each worker's pool size is deterministic and
the workers of one GPU never race each other for its free memory.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockAllocator
from engine.kv_cache import allocate_kv_pool, block_nbytes, kv_blocks_for_budget
from engine.sampler import SampleRequest, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.runner import ModelRunner

logger = logging.getLogger(__name__)
GIB = 1 << 30


def gpu_kv_blocks(runner: ModelRunner) -> int:
    """KV blocks for ``runner``'s share of its GPU (weights loaded, no pool yet).

    Weights are what the process allocated since ``runner.cuda_baseline_bytes`` (taken
    before the model was built), so other engines in the same process do not count.
    """
    dev, config, mcfg = runner.device, runner.config, runner.model_config
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev)  # this process's, other engines' included
    weights = held - runner.cuda_baseline_bytes
    torch.cuda.reset_peak_memory_stats(dev)
    scratch = profile_forward(runner)
    torch.cuda.synchronize(dev)
    peak = max(0, torch.cuda.max_memory_allocated(dev) - held - scratch)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    share = config.gpu_memory_share or config.gpu_memory_utilization
    per_block = block_nbytes(mcfg, runner.block_size, runner.dtype)
    # NOTE: CUDA decode gathers one layer of the batch's K/V at a time (engine/attention.py);
    # with the pool full that is the pool's bytes / num_layers, on top of the pool itself.
    per_block += -(-per_block // mcfg.num_layers)
    blocks = kv_blocks_for_budget(total, share, weights, peak, per_block)
    logger.info(
        "GPU memory: %.2f GiB share (%.1f%%), %.2f GiB weights, %.2f GiB activation peak "
        "-> %d KV blocks", total * share / GIB, 100 * share, weights / GIB, peak / GIB, blocks,
    )  # fmt: skip
    return blocks


def profile_forward(runner: ModelRunner) -> int:
    """Run ``runner``'s largest forwards on a scratch pool; returns the pool's bytes.

    One prefill chunk of ``chunked_prefill_size`` tokens, then ``max_num_seqs`` decode
    rows, each sampled with top-k/top-p and top-20 logprobs (the costliest sampling): the
    peak covers whichever needs more. The scratch pool and allocator are gone on return.
    """
    config, bs = runner.config, runner.block_size
    chunk = min(config.chunked_prefill_size, runner.max_model_len)
    rows = config.max_num_seqs
    num_blocks = -(-chunk // bs) + rows * -(-2 // bs)
    runner.kv_pool = allocate_kv_pool(
        runner.model_config, num_blocks, bs, runner.dtype, runner.device
    )
    runner.allocator = BlockAllocator(num_blocks)
    params = SamplingParams(max_tokens=2, top_k=50, top_p=0.9, logprobs=20)
    rng = torch.Generator(device=runner.device)  # the runner's own generator stays untouched
    try:
        long = Sequence(rid=-1, prompt_ids=[0] * chunk, sampling=params, block_size=bs)
        _sample(runner.prefill([(long, chunk)]), [long], rng)
        short = [Sequence(rid=-2 - r, prompt_ids=[0, 0], sampling=params, block_size=bs)
                 for r in range(rows)]  # fmt: skip
        runner.prefill([(seq, 1) for seq in short])
        _sample(runner.decode(short), short, rng)
        return int(runner.kv_pool.numel() * runner.kv_pool.element_size())
    finally:
        del runner.kv_pool, runner.allocator


def _sample(logits: torch.Tensor, seqs: list[Sequence], rng: torch.Generator) -> None:
    sample(logits, [SampleRequest(s.sampling, s.prompt_ids, s.output_ids) for s in seqs], rng)
