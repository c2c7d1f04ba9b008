"""Host memory admission: RAM and cgroup limits, not /dev/shm, bound the KV budget, and a
budget beyond them is refused before anything is created or spawned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from launcher import cli
from launcher.args import ConfigError, KVTransfer, parse_args
from launcher.memory import (
    GiB,
    HostMemory,
    cgroup_available,
    check_host_memory,
    meminfo_available,
    memory_need,
    weight_nbytes,
)

MiB = 1 << 20


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
    _files(tmp_path, {
        "self_cgroup": "0::/outer/inner\n",
        "fs/outer/memory.max": f"{2 * GiB}\n", "fs/outer/memory.current": f"{GiB}\n",
        "fs/outer/memory.stat": "anon 1\ninactive_file 0\n",
        "fs/outer/inner/memory.max": "max\n", "fs/outer/inner/memory.current": "5\n",
    })  # fmt: skip
    # inner has no limit; outer's 2 GiB, with 1 GiB in use, leaves 1 GiB
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") == (
        GiB, str(tmp_path / "fs/outer/memory.max"))  # fmt: skip
    # reclaimable page cache does not count as used
    _files(tmp_path, {"fs/outer/memory.stat": f"inactive_file {GiB // 2}\n"})
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs")[0] == GiB + GiB // 2  # type: ignore[index]


def test_cgroup_v2_namespaced_mount_and_no_limit(tmp_path: Path) -> None:
    # Inside a container the cgroup's host path is not under the mount: its root is it.
    _files(tmp_path, {"self_cgroup": "0::/docker/abc\n", "fs/memory.max": f"{GiB}\n",
                      "fs/memory.current": "0\n"})  # fmt: skip
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") == (
        GiB, str(tmp_path / "fs/memory.max"))  # fmt: skip
    _files(tmp_path, {"fs/memory.max": "max\n"})
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") is None


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    _files(tmp_path, {
        "self_cgroup": "5:cpu:/\n4:memory:/job\n0::/\n",
        "fs/memory/job/memory.limit_in_bytes": f"{3 * GiB}\n",
        "fs/memory/job/memory.usage_in_bytes": f"{2 * GiB}\n",
        "fs/memory/job/memory.stat": f"cache 5\ntotal_inactive_file {GiB}\n",
        "fs/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "fs/memory/memory.usage_in_bytes": "1\n",
    })  # fmt: skip
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs")[0] == 2 * GiB  # type: ignore[index]
    _files(tmp_path, {"fs/memory/job/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_available(tmp_path / "self_cgroup", tmp_path / "fs") is None


def test_weight_estimate_matches_the_checkpoint(default_model_path: Path) -> None:
    from safetensors import safe_open

    m = ModelConfig.from_pretrained(default_model_path)
    params = 0
    for f in default_model_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            params += sum(st.get_tensor(k).numel() for k in st.keys())  # noqa: SIM118
    assert weight_nbytes(m, torch.float32) == params * 4


def test_a_kv_budget_beyond_ram_is_refused_naming_the_flag(default_model_path: Path) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    config = parse_args(["--device", "cpu", "--kv-cache-tokens", str(8 * 1024 * 1024)])
    need = memory_need(config, m, torch.float32, on_cpu=True, backend=KVTransfer.SHM)
    assert need.kv_pools == 2 and need.weight_copies == 2  # 1 prefill + 1 decode on CPU
    mem = HostMemory(need.total // 2, "MemAvailable in /proc/meminfo")
    with pytest.raises(ConfigError, match="--kv-cache-tokens") as e:
        check_host_memory(config, need, mem)
    assert "MemAvailable" in str(e.value) and "would fit" in str(e.value)
    check_host_memory(config, need, HostMemory(need.total, "test"))  # exactly fits


def test_gpu_workers_hold_only_shm_staging_mirrors_in_host_memory(
    default_model_path: Path,
) -> None:
    m = ModelConfig.from_pretrained(default_model_path)
    config = parse_args(["--prefill", "2", "--decode", "3"])
    shm = memory_need(config, m, torch.bfloat16, on_cpu=False, backend=KVTransfer.SHM)
    ipc = memory_need(config, m, torch.bfloat16, on_cpu=False, backend=KVTransfer.CUDA_IPC)
    assert (shm.kv_pools, shm.weight_copies, ipc.kv_pools) == (2, 0, 0)


def test_serve_refuses_before_creating_or_spawning_anything(
    monkeypatch: pytest.MonkeyPatch, default_model_path: Path
) -> None:
    def must_not_run(*args: object) -> None:
        raise AssertionError("shared memory was created for a server that cannot fit")

    monkeypatch.setattr(cli, "_build_topology", must_not_run)
    monkeypatch.setattr(cli, "host_memory", lambda: HostMemory(64 * MiB, "test"))
    config = parse_args(["--model", str(default_model_path), "--device", "cpu", "--port", "0"])
    with pytest.raises(ConfigError, match="not enough host memory"):
        cli.serve(config)


def test_launch_refuses_a_kv_budget_beyond_ram_before_spawning(default_model_path: Path) -> None:
    """The command an operator types: exit 2, a message naming what to lower, no child."""
    import subprocess
    import sys

    m = ModelConfig.from_pretrained(default_model_path)
    per_token = memory_need(parse_args([]), m, torch.float32, True, KVTransfer.SHM)
    ram = meminfo_available() or 64 * GiB
    tokens = 4 * ram // per_token.kv_bytes_per_token  # each pool four times what is free
    cmd = [sys.executable, "-m", "launcher.cli", "--device", "cpu", "--port", "0",
           "--model", str(default_model_path), "--kv-cache-tokens", str(tokens)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "not enough host memory" in out.stderr and "--kv-cache-tokens" in out.stderr
    assert "started" not in out.stderr + out.stdout  # no child was spawned
