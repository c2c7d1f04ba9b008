"""``benchmarks.engine.kv_prefetch_ab``: its paired medians, and its attention rounds."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine import kv_prefetch_ab
from engine.kernels.cpu.ops import decode_attention_op


def test_paired_gives_both_medians_and_the_ratios_median_and_quartiles() -> None:
    times = {"L2": [1e-3, 2e-3, 4e-3, 8e-3], "L1": [0.5e-3, 2e-3, 3e-3, 8e-3]}
    # ratios 0.5, 1.0, 0.75, 1.0 -> sorted 0.5, 0.75, 1.0, 1.0
    assert kv_prefetch_ab.paired(times) == "3.000 | 2.500 | 0.875x (0.750-1.000)"


def test_attention_rounds_take_turns_and_count_the_contexts_bytes() -> None:
    op = decode_attention_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        times, nbytes = kv_prefetch_ab.attention_alone(op, 2, 40, 3, pool_blocks=8)
    finally:
        torch.set_num_threads(before)
    assert set(times) == {"L2", "L1"}
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert nbytes == 30 * 2 * 40 * 3 * 64 * 2 * 2  # layers, rows, tokens, KV heads, dims, K+V, bf16
