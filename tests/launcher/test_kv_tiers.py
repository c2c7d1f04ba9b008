"""The KV-tier flags: validated up front, and tier 2 counted in the memory budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from launcher.args import parse_args
from launcher.kv_tiers import offload_bytes
from launcher.memory import GIB, Demand, HostMemory, MemoryBudgetError, plan_kv
from launcher.settings import ConfigError


def test_the_disk_tier_needs_host_ram_and_prefix_caching(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--kv-offload-memory"):
        parse_args(["--kv-offload-dir", str(tmp_path), "--kv-offload-memory", "0"])
    with pytest.raises(ConfigError, match="prefix caching"):
        parse_args(["--kv-offload-dir", str(tmp_path), "--no-enable-prefix-caching"])
    with pytest.raises(ConfigError, match="--kv-offload-disk"):
        parse_args(["--kv-offload-disk", "0"])
    c = parse_args(["--kv-offload-dir", str(tmp_path), "--kv-offload-memory", "0.5"])
    assert offload_bytes(c) == GIB // 2
    assert offload_bytes(parse_args(["--no-enable-prefix-caching"])) == 0


def test_tier_2_is_taken_from_the_memory_budget(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    memory = HostMemory(4 * GIB, "test")
    demand = Demand(engines=2, others=2, pools=2, chunk=512, max_model_len=1024)
    without = plan_kv(m, 10 << 20, torch.float32, demand, memory=memory)
    with_tier = plan_kv(
        m, 10 << 20, torch.float32, Demand(**{**demand.__dict__, "offload": GIB}), memory=memory
    )
    assert with_tier.bytes_per_pool < without.bytes_per_pool
    with pytest.raises(MemoryBudgetError):
        plan_kv(
            m,
            10 << 20,
            torch.float32,
            Demand(**{**demand.__dict__, "offload": 4 * GIB}),
            kv_cache_memory_gib=0.1,
            memory=memory,
        )
