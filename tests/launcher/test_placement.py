"""Where workers run and what they are told, from explicit GPU inventories (no NVML)."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import pytest

from launcher.args import parse_args
from launcher.cli import _build_topology, _children
from launcher.engine_plan import size_kv
from launcher.gpus import GpuInfo, assign_gpus
from launcher.placement import kv_transfer_backend, placements
from launcher.settings import ConfigError, KVBackend
from runtime.strict_spec import decode_spec
from runtime.worker_spec import EngineWorkerSpec

GIB = 1 << 30
GPUS = [GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 * GIB, 80 * GIB) for i in range(4)]


def test_auto_backend_is_cuda_ipc_on_gpus_and_shm_on_cpu() -> None:
    on_gpu = parse_args(shlex.split("--prefill 1 --decode 1"))
    assert kv_transfer_backend(on_gpu, assign_gpus(on_gpu, GPUS)) is KVBackend.CUDA_IPC
    assert kv_transfer_backend(on_gpu, assign_gpus(on_gpu, [])) is KVBackend.SHM
    shm = parse_args(["--kv-transfer", "shm"])
    assert kv_transfer_backend(shm, assign_gpus(shm, GPUS)) is KVBackend.SHM


def test_cuda_ipc_without_gpus_is_refused() -> None:
    cfg = parse_args(["--kv-transfer", "cuda_ipc"])  # --device auto on a host with no GPU
    with pytest.raises(ConfigError, match="cuda_ipc needs GPUs"):
        kv_transfer_backend(cfg, assign_gpus(cfg, []))


def test_workers_sharing_a_gpu_split_its_utilization() -> None:
    argv = shlex.split("--prefill 1 --decode 2 --prefill-gpus 0 --decode-gpus 0,1")
    cfg = parse_args([*argv, "--gpu-memory-utilization", "0.8"])
    places = {(p.role, p.index): p for p in placements(assign_gpus(cfg, GPUS), 0.8)}
    assert places["prefill", 0].gpu_memory_share == pytest.approx(0.4)
    assert places["decode", 0].gpu_memory_share == pytest.approx(0.4)
    assert places["decode", 1].gpu_memory_share == pytest.approx(0.8)  # GPU 1 alone
    assert places["decode", 1].env() == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "1",
    }


def _children_for(argv: list[str], model: Path) -> dict[str, tuple[dict, dict, dict]]:  # type: ignore[type-arg]
    cfg = parse_args([*argv, "--model", str(model), "--kv-cache-tokens", "256"])
    gpus = assign_gpus(cfg, GPUS)
    backend = kv_transfer_backend(cfg, gpus)
    kids = _children(cfg, _build_topology(cfg, model, backend), gpus, model, backend)
    return {c.name: (c.spec.settings, c.env, c.spec.kv_pools) for c in kids}


def test_children_on_one_shared_gpu_with_cuda_ipc(default_model_path: Path) -> None:
    kids = _children_for(
        shlex.split("--prefill-gpus 0 --decode-gpus 0 --max-queued-prefill-tokens 5000"),
        default_model_path,
    )
    for name in ("prefill-0", "decode-0"):
        settings, env, kv_pools = kids[name]
        assert settings["engine"]["device"] == "cuda" and settings["kv_transfer"] == "cuda_ipc"
        assert settings["engine"]["gpu_memory_share"] == pytest.approx(0.85 / 2)
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and kv_pools == {}  # no shared KV segment
    for name in ("frontend-0", "detok-0"):
        assert kids[name][1]["CUDA_VISIBLE_DEVICES"] == ""  # CPU-only processes
    assert kids["frontend-0"][0]["max_queued_prefill_tokens"] == 5000


def test_children_with_shm_on_gpus_get_a_staging_mirror(default_model_path: Path) -> None:
    kids = _children_for(["--kv-transfer", "shm"], default_model_path)
    p_settings, p_env, p_pools = kids["prefill-0"]
    d_settings, d_env, d_pools = kids["decode-0"]
    assert (p_env["CUDA_VISIBLE_DEVICES"], d_env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert p_settings["kv_transfer"] == d_settings["kv_transfer"] == "shm"
    assert (
        p_settings["engine"]["gpu_memory_share"] == d_settings["engine"]["gpu_memory_share"] == 0.85
    )
    assert p_pools["p0"]["layout"]["num_blocks"] == 256 // 16 and d_pools.keys() == {"p0"}


def test_children_on_cpu_are_told_what_they_always_were(default_model_path: Path) -> None:
    cfg = parse_args(["--device", "cpu", "--model", str(default_model_path)])
    gpus = assign_gpus(cfg, GPUS)
    cfg = size_kv(cfg, default_model_path, gpus, KVBackend.SHM)  # from available memory
    assert cfg.kv_cache_tokens is not None and cfg.kv_cache_tokens > 0
    kids = _children(
        cfg,
        _build_topology(cfg, default_model_path, KVBackend.SHM),
        gpus,
        default_model_path,
        KVBackend.SHM,
    )
    prefill = next(c for c in kids if c.name == "prefill-0")
    spec = decode_spec(prefill.spec.settings, EngineWorkerSpec)  # as the worker reads it
    assert spec.engine.device == "cpu" and spec.kv_transfer == "shm"
    # One host names its node too (its host name here): /health and /metrics show it.
    assert spec.node == socket.gethostname() and spec.remote_decode == []
    frontend = next(c for c in kids if c.name == "frontend-0").spec.settings
    assert frontend["node"] == socket.gethostname() and not frontend["remote_decode"]
    assert spec.engine.gpu_memory_share is None
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == "" and "p0" in prefill.spec.kv_pools


def test_a_head_names_its_node_and_tells_the_frontend_its_reserve(
    default_model_path: Path,
) -> None:
    cfg = parse_args(
        [
            "--device",
            "cpu",
            "--model",
            str(default_model_path),
            *shlex.split(
                "--decode 1 --kv-cache-tokens 256 --remote-decode 2 --advertise 10.0.0.1 --node-name a --cluster-key sixteen-chars-or-more"
            ),
        ]
    )
    gpus = assign_gpus(cfg, [])
    topo = _build_topology(cfg, default_model_path, KVBackend.SHM, gpus)
    kids = {c.name: c for c in _children(cfg, topo, gpus, default_model_path, KVBackend.SHM)}
    frontend = kids["frontend-0"].spec.settings
    assert frontend["node"] == "a" and list(frontend["remote_decode"]) == [1, 2]
    for name in ("prefill-0", "decode-0"):
        assert decode_spec(kids[name].spec.settings, EngineWorkerSpec).node == "a"


def test_each_engine_worker_gets_its_prefix_summary_and_the_frontend_all_of_them(
    default_model_path: Path,
) -> None:
    from transport.prefix_summary import summary_nbytes

    argv = ["--device", "cpu", "--model", str(default_model_path), "--kv-cache-tokens", "4096"]
    for caching in ([], ["--no-enable-prefix-caching"]):
        cfg = parse_args([*argv, *shlex.split("--prefill 2 --decode 1"), *caching])
        gpus = assign_gpus(cfg, [])
        topo = _build_topology(cfg, default_model_path, KVBackend.SHM, gpus)
        kids = {c.name: c for c in _children(cfg, topo, gpus, default_model_path, KVBackend.SHM)}
        if caching:
            assert all(not c.spec.prefix_summaries for c in kids.values())
            assert kids["frontend-0"].spec.settings["router_policy"] == "least-load"
            continue
        for name, peer in (("prefill-0", "p0"), ("prefill-1", "p1"), ("decode-0", "d0")):
            summaries = kids[name].spec.prefix_summaries
            assert summaries.keys() == {peer} and summaries[peer]["fd"] in kids[name].spec.fds()
            # 256 blocks of 16 tokens, 8 counters each: 2048 -> the 4096 minimum.
            assert summaries[peer]["nbytes"] == summary_nbytes(4096)
        assert kids["frontend-0"].spec.prefix_summaries.keys() == {"p0", "p1", "d0"}
        assert kids["frontend-0"].spec.settings["router_policy"] == "cache-aware"
        assert not kids["detok-0"].spec.prefix_summaries
