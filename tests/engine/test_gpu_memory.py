"""GPU KV sizing: the arithmetic of a worker's share, and the profiling forward it measures.

The arithmetic and the profiling run are device-agnostic and run here on CPU; the one test
that reads real GPU memory is skipped without an NVIDIA GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.build import build_engine
from engine.config import EngineConfig, ModelConfig
from engine.cuda.gpu_memory import profile_forward
from engine.kv.kv_cache import GpuMemoryError, kv_blocks_for_budget, pool_layout

GIB = 1 << 30
MIB = 1 << 20


def test_blocks_are_the_share_left_after_weights_and_activations() -> None:
    # 80 GiB GPU, 0.9 for the worker alone: 72 GiB - 16 weights - 4 activations = 52 GiB.
    assert kv_blocks_for_budget(80 * GIB, 0.9, 16 * GIB, 4 * GIB, 2 * MIB) == 52 * 512


def test_workers_sharing_a_gpu_each_get_their_part_and_together_stay_within_it() -> None:
    total, util, weights, act, block = 80 * GIB, 0.9, 16 * GIB, 4 * GIB, 2 * MIB
    alone = kv_blocks_for_budget(total, util, weights, act, block)
    shared = kv_blocks_for_budget(total, util / 2, weights, act, block)
    assert shared == (36 - 20) * 512  # 36 GiB each: 16 GiB of KV, not half of 52
    assert 2 * (shared * block + weights + act) <= util * total < alone * block + 2 * weights


def test_a_model_that_does_not_fit_its_share_is_a_clear_error() -> None:
    with pytest.raises(GpuMemoryError, match=r"weights .* more than this worker's 8\.00 GiB"):
        kv_blocks_for_budget(80 * GIB, 0.1, 7 * GIB, 2 * GIB, 2 * MIB)
    with pytest.raises(GpuMemoryError, match="less than one block"):
        kv_blocks_for_budget(10 * GIB, 0.5, 5 * GIB - MIB, 0, 2 * MIB)
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\]"):
        kv_blocks_for_budget(10 * GIB, 1.5, 0, 0, 2 * MIB)


def test_profiling_runs_the_largest_forwards_on_a_scratch_pool_and_keeps_the_rng(
    default_model_path: Path,
) -> None:
    config = EngineConfig(
        model=str(default_model_path), chunked_prefill_size=40, max_num_seqs=5, num_kv_blocks=4
    )
    runner = build_engine(config).runner
    state = runner.generator.get_state()
    pool, free = runner.kv.tensor.clone(), runner.kv.allocator.num_free
    scratch = profile_forward(runner)
    m = ModelConfig.from_pretrained(default_model_path)
    # 40 prompt tokens: 3 blocks of 16; 5 decode rows of 2 tokens: a block each.
    assert scratch == (3 + 5) * pool_layout(m, 1, 16, runner.dtype).block_nbytes
    # The runner is untouched: its own pool and allocator were never used.
    assert torch.equal(runner.kv.tensor, pool) and runner.kv.allocator.num_free == free
    assert torch.equal(runner.generator.get_state(), state)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_pool_is_sized_from_the_share_alone(default_model_path: Path) -> None:
    def blocks(share: float) -> int:
        cfg = EngineConfig(model=str(default_model_path), device="cuda", gpu_memory_share=share)
        runner = build_engine(cfg).runner
        total = torch.cuda.mem_get_info()[1]
        assert runner.kv.tensor.numel() * runner.kv.tensor.element_size() < share * total
        return runner.kv.allocator.num_blocks

    # The process's first engine also creates what lives as long as the process (cuBLAS
    # workspaces, Triton's scratch) during its profile, and counts it in its activation
    # peak; a worker process has one engine. Measure from the second on.
    blocks(0.05)
    first = blocks(0.05)
    held = torch.zeros(1 << 28, device="cuda")  # 1 GiB held elsewhere in this process
    assert blocks(0.05) == first > 0  # deterministic, whatever else is allocated
    assert blocks(0.1) > 1.9 * first
    del held
