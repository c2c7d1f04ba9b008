"""The KV budget: arithmetic from available memory, explicit budgets checked, clear errors."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from launcher.memory import (
    DEFAULT_KV_CAP,
    GIB,
    Demand,
    HostMemory,
    KVPlan,
    MemoryBudgetError,
    cgroup_available,
    host_memory,
    kv_bytes_per_token,
    meminfo_available,
    plan_kv,
    weight_bytes,
)

MiB = 1 << 20

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
    roomy = plan_kv(m, 100 << 20, torch.float32, _demand(), memory=HostMemory(200 * GIB, "test"))
    assert roomy.bytes_per_pool == DEFAULT_KV_CAP // per_token * per_token  # capped
    small = plan_kv(m, 100 << 20, torch.float32, _demand(), memory=HostMemory(8 * GIB, "test"))
    assert 0 < small.bytes_per_pool < DEFAULT_KV_CAP
    # Four pools of that size fit within 90 % of 8 GiB next to the four workers.
    assert 4 * small.bytes_per_pool < 0.9 * 8 * GIB - 4 * (100 << 20)
    more = plan_kv(m, 100 << 20, torch.float32, _demand(8, 8), memory=HostMemory(8 * GIB, "test"))
    assert more.tokens_per_pool < small.tokens_per_pool
    assert "GiB" in small.describe(4) and str(small.tokens_per_pool) in small.describe(4)


def test_a_machine_too_small_for_the_replicas_is_an_error(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    with pytest.raises(MemoryBudgetError, match="lower --prefill/--decode"):
        plan_kv(m, 2 * GIB, torch.float32, _demand(), memory=HostMemory(8 * GIB, "test"))


def test_shared_weights_are_counted_once_per_host(default_model_path: Path) -> None:
    """Four workers mapping one 1 GiB copy leave the pools 3 GiB more than four private
    copies would, and a budget the private copies could not hold fits the shared one."""
    from dataclasses import replace

    m = ModelConfig.from_pretrained(default_model_path)
    mem = HostMemory(16 * GIB, "test")
    private = plan_kv(m, GIB, torch.float32, _demand(), memory=mem)
    shared = plan_kv(m, 0, torch.float32, replace(_demand(), shared_weights=GIB), memory=mem)
    gained = 4 * (shared.bytes_per_pool - private.bytes_per_pool)
    per_pool_token = kv_bytes_per_token(m, 4)
    assert abs(gained - 3 * GIB) <= 4 * per_pool_token
    assert "1.00 GiB shared once by all" in shared.describe(4)
    with pytest.raises(MemoryBudgetError):
        plan_kv(m, GIB, torch.float32, _demand(), kv_cache_memory_gib=2.0, memory=mem)
    plan_kv(
        m,
        0,
        torch.float32,
        replace(_demand(), shared_weights=GIB),
        kv_cache_memory_gib=2.0,
        memory=mem,
    )


def _plan_on_32_gib(m: ModelConfig, **budget: Any) -> KVPlan:
    """``plan_kv`` for 1 MiB of weights on a 32 GiB machine, with an explicit ``budget``."""
    return plan_kv(
        m, 1 << 20, torch.float32, _demand(), memory=HostMemory(32 * GIB, "test"), **budget
    )


def test_explicit_budgets_beyond_the_machine_are_errors(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    fits = _plan_on_32_gib(m, kv_cache_memory_gib=1)
    assert fits.tokens_per_pool == GIB // kv_bytes_per_token(m, 4)
    with pytest.raises(MemoryBudgetError, match="--kv-cache-memory 10"):
        _plan_on_32_gib(m, kv_cache_memory_gib=10)
    with pytest.raises(MemoryBudgetError, match="--kv-cache-tokens"):
        _plan_on_32_gib(m, kv_cache_tokens=10**9)
    tokens = _plan_on_32_gib(m, kv_cache_tokens=4096)
    assert tokens.tokens_per_pool == 4096


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_meminfo_available_is_read_in_bytes(tmp_path: Path) -> None:
    _files(tmp_path, {"meminfo": "MemTotal: 4000 kB\nMemFree: 100 kB\nMemAvailable: 2048 kB\n"})
    assert meminfo_available(tmp_path / "meminfo") == 2 * MiB
    assert meminfo_available(tmp_path / "missing") is None


def test_cgroup_v2_limit_less_working_set_over_the_tightest_ancestor(tmp_path: Path) -> None:
    _files(
        tmp_path,
        {
            "self_cgroup": "0::/outer/inner\n",
            "fs/outer/memory.max": f"{2 * GIB}\n",
            "fs/outer/memory.current": f"{GIB}\n",
            "fs/outer/memory.stat": "anon 1\ninactive_file 0\n",
            "fs/outer/inner/memory.max": "max\n",
            "fs/outer/inner/memory.current": "5\n",
        },
    )
    # inner has no limit; outer's 2 GIB, with 1 GIB in use, leaves 1 GIB
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") == (
        GIB,
        str(tmp_path / "fs/outer/memory.max"),
    )
    # reclaimable page cache does not count as used
    _files(tmp_path, {"fs/outer/memory.stat": f"inactive_file {GIB // 2}\n"})
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs")[0] == GIB + GIB // 2  # type: ignore[index]


def test_cgroup_v2_namespaced_mount_and_no_limit(tmp_path: Path) -> None:
    # Inside a container the cgroup's host path is not under the mount: its root is it.
    _files(
        tmp_path,
        {
            "self_cgroup": "0::/docker/abc\n",
            "fs/memory.max": f"{GIB}\n",
            "fs/memory.current": "0\n",
        },
    )
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") == (
        GIB,
        str(tmp_path / "fs/memory.max"),
    )
    _files(tmp_path, {"fs/memory.max": "max\n"})
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") is None


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    _files(
        tmp_path,
        {
            "self_cgroup": "5:cpu:/\n4:memory:/job\n0::/\n",
            "fs/memory/job/memory.limit_in_bytes": f"{3 * GIB}\n",
            "fs/memory/job/memory.usage_in_bytes": f"{2 * GIB}\n",
            "fs/memory/job/memory.stat": f"cache 5\ntotal_inactive_file {GIB}\n",
            "fs/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "fs/memory/memory.usage_in_bytes": "1\n",
        },
    )
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs")[0] == 2 * GIB  # type: ignore[index]
    _files(tmp_path, {"fs/memory/job/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") is None


def test_available_memory_is_positive_and_below_the_machine() -> None:
    lines = Path("/proc/meminfo").read_text().splitlines()
    total = int(next(line for line in lines if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < host_memory().available <= total


def test_launch_refuses_a_kv_budget_over_ram_before_spawning(default_model_path: Path) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "--model",
            str(default_model_path),
            *shlex.split("--device cpu --port 0 --kv-cache-memory 100000"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "--kv-cache-memory 100000" in out.stderr and "lower it" in out.stderr
    assert "started" not in out.stderr  # nothing was spawned
    assert time.monotonic() - start < 60


def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        weight_bytes(tmp_path, torch.float32)
