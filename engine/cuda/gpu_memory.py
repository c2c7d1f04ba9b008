"""Sizing a GPU KV pool: this engine's share of its GPU, minus weights and activations.

Measured, not read from free memory: the weights are what this process has allocated, the
activations the peak of profiling forwards beyond that. Neither changes when other workers
start on the same GPU at the same moment, so each worker's pool size is deterministic and
the workers of one GPU never race each other for its free memory.
"""

from __future__ import annotations

import gc
import logging
from typing import Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv.kv_cache import allocate_kv_pool, kv_blocks_for_budget, pool_layout
from engine.kv.sequence import Sequence
from engine.sampling.sampler import SampleRequest, sample
from wire.params import SamplingParams

logger = logging.getLogger(__name__)
GIB = 1 << 30


class Profiled(Protocol):
    """What the profile needs of an engine whose weights are loaded (``ModelRunner``)."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    cuda_baseline_bytes: int

    def prefill(self, chunks: list[tuple[Sequence, int]], pool: torch.Tensor) -> torch.Tensor: ...
    def decode(self, seqs: list[Sequence], pool: torch.Tensor) -> torch.Tensor: ...


def gpu_kv_blocks(runner: Profiled) -> int:
    """KV blocks for ``runner``'s share of its GPU (weights loaded, no pool yet).

    Weights are what the process allocated since ``runner.cuda_baseline_bytes`` (taken
    before the model was built), so other engines in the same process do not count.
    """
    dev, config, mcfg = runner.device, runner.config, runner.model_config
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev)  # this process's, other engines' included
    weights = held - runner.cuda_baseline_bytes
    torch.cuda.reset_peak_memory_stats(dev)
    # NOTE: no garbage collection mid-measure: freeing an earlier engine's cycles in the
    # same process during the profile would shrink the measured peak (seen on an H200).
    # The runner collected before taking its baseline.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        scratch = profile_forward(runner)
    finally:
        if was_enabled:
            gc.enable()
    torch.cuda.synchronize(dev)
    peak = max(0, torch.cuda.max_memory_allocated(dev) - held - scratch)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    share = config.gpu_memory_share or config.gpu_memory_utilization
    per_block = pool_layout(mcfg, 1, runner.block_size, runner.dtype).block_nbytes
    # NOTE: CUDA decode gathers one layer of the batch's K/V at a time (engine/model/attention.py);
    # with the pool full that is the pool's bytes / num_layers, on top of the pool itself.
    per_block += -(-per_block // mcfg.num_layers)
    blocks = kv_blocks_for_budget(total, share, weights, peak, per_block)
    logger.info(
        "GPU memory: %.2f GiB share (%.1f%%), %.2f GiB weights, %.2f GiB activation peak "
        "-> %d KV blocks",
        total * share / GIB,
        100 * share,
        weights / GIB,
        peak / GIB,
        blocks,
    )
    return blocks


def profile_forward(runner: Profiled) -> int:
    """Run ``runner``'s largest forwards on a scratch pool; returns the pool's bytes.

    One prefill chunk of ``chunked_prefill_size`` tokens, then ``max_num_seqs`` decode
    rows, each sampled with top-k/top-p and top-20 logprobs (the costliest sampling): the
    peak covers whichever needs more. The runner is not changed: the scratch pool is passed
    to its forwards, and the scratch sequences own their block ids outright.
    """
    config, bs = runner.config, runner.block_size
    chunk = min(config.chunked_prefill_size, runner.max_model_len)
    rows = config.max_num_seqs
    chunk_blocks, row_blocks = -(-chunk // bs), -(-2 // bs)
    num_blocks = chunk_blocks + rows * row_blocks
    pool = allocate_kv_pool(runner.model_config, num_blocks, bs, runner.dtype, runner.device)
    params = SamplingParams(max_tokens=2, top_k=50, top_p=0.9, logprobs=20)
    rng = torch.Generator(device=runner.device)  # the runner's own generator stays untouched
    ids = iter(range(num_blocks))

    def scratch(rid: int, prompt: list[int], blocks: int) -> Sequence:
        seq = Sequence(rid=rid, prompt_ids=prompt, sampling=params, block_size=bs)
        seq.block_table = [next(ids) for _ in range(blocks)]
        return seq

    long = scratch(-1, [0] * chunk, chunk_blocks)
    _sample(runner.prefill([(long, chunk)], pool), [long], rng)
    short = [scratch(-2 - r, [0, 0], row_blocks) for r in range(rows)]
    runner.prefill([(seq, 1) for seq in short], pool)
    _sample(runner.decode(short, pool), short, rng)
    return int(pool.numel() * pool.element_size())


def _sample(logits: torch.Tensor, seqs: list[Sequence], rng: torch.Generator) -> None:
    sample(logits, [SampleRequest(s.sampling, s.prompt_ids, s.output_ids) for s in seqs], rng)
