"""The KV budget: arithmetic from available memory, explicit budgets checked, clear errors."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from launcher.memory import (
    DEFAULT_KV_CAP,
    GIB,
    Demand,
    MemoryBudgetError,
    available_bytes,
    kv_bytes_per_token,
    plan_kv,
    weight_bytes,
)

REPO = Path(__file__).resolve().parents[2]


def _demand(engines: int = 4, pools: int = 4) -> Demand:
    return Demand(engines=engines, others=3, pools=pools, chunk=2048, max_model_len=1024)


def test_weight_bytes_counts_every_tensor_in_the_serving_dtype(default_model_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(default_model_path / "model.safetensors")
    numel = sum(t.numel() for t in tensors.values())
    assert weight_bytes(default_model_path, torch.float32) == 4 * numel
    assert weight_bytes(default_model_path, torch.bfloat16) == 2 * numel


def test_default_budget_splits_what_is_left_after_the_workers(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    per_token = kv_bytes_per_token(m, 4)
    roomy = plan_kv(m, 100 << 20, torch.float32, _demand(), available=200 * GIB)
    assert roomy.bytes_per_pool == DEFAULT_KV_CAP // per_token * per_token  # capped
    small = plan_kv(m, 100 << 20, torch.float32, _demand(), available=8 * GIB)
    assert 0 < small.bytes_per_pool < DEFAULT_KV_CAP
    # Four pools of that size fit within 90 % of 8 GiB next to the four workers.
    assert 4 * small.bytes_per_pool < 0.9 * 8 * GIB - 4 * (100 << 20)
    more = plan_kv(m, 100 << 20, torch.float32, _demand(8, 8), available=8 * GIB)
    assert more.tokens_per_pool < small.tokens_per_pool
    assert "GiB" in small.describe(4) and str(small.tokens_per_pool) in small.describe(4)


def test_a_machine_too_small_for_the_replicas_is_an_error(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    with pytest.raises(MemoryBudgetError, match="lower --prefill/--decode"):
        plan_kv(m, 2 * GIB, torch.float32, _demand(), available=8 * GIB)


def test_explicit_budgets_beyond_the_machine_are_errors(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    fits = plan_kv(m, 1 << 20, torch.float32, _demand(), kv_cache_memory_gib=1, available=32 * GIB)
    assert fits.tokens_per_pool == GIB // kv_bytes_per_token(m, 4)
    with pytest.raises(MemoryBudgetError, match="--kv-cache-memory 10"):
        plan_kv(m, 1 << 20, torch.float32, _demand(), kv_cache_memory_gib=10, available=32 * GIB)
    with pytest.raises(MemoryBudgetError, match="--kv-cache-tokens"):
        plan_kv(m, 1 << 20, torch.float32, _demand(), kv_cache_tokens=10**9, available=32 * GIB)
    tokens = plan_kv(m, 1 << 20, torch.float32, _demand(), kv_cache_tokens=4096,
                     available=32 * GIB)  # fmt: skip
    assert tokens.tokens_per_pool == 4096


def test_available_memory_is_positive_and_below_the_machine() -> None:
    lines = Path("/proc/meminfo").read_text().splitlines()
    total = int(next(line for line in lines if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < available_bytes() <= total


def test_launch_refuses_a_kv_budget_over_ram_before_spawning(default_model_path: Path) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--model", str(default_model_path),
         "--device", "cpu", "--port", "0", "--kv-cache-memory", "100000"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--kv-cache-memory 100000" in out.stderr and "lower it" in out.stderr
    assert "started" not in out.stderr  # nothing was spawned
    assert time.monotonic() - start < 60


def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        weight_bytes(tmp_path, torch.float32)
