"""``launch``: the one command operators type.

    launch --prefill 2 --decode 4        # N prefill + M decode workers, one per GPU (or CPU)
    launch --prefill-gpus 0 --decode-gpus 0   # both roles share GPU 0
    launch --colocated 2                 # baseline: N workers that prefill and decode

Order of work: parse and validate flags -> sweep leftovers of dead servers -> assign GPUs
-> create every shared resource (rings, load table, KV pools) -> spawn frontend, workers
and detokenizer shards -> wait until all are ready -> print the URL -> watch, restart,
and on SIGINT/SIGTERM stop everything within 10 s.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from engine.config import EngineConfig, ModelConfig
from launcher import cluster, kv_tiers
from launcher.args import parse_args
from launcher.engine_config import engine_config
from launcher.engine_plan import kv_layout, shares_weights, size_kv
from launcher.frontend_config import frontend_launch
from launcher.gpus import GpuAssignment, assign_gpus, cuda_env
from launcher.placement import WorkerPlace, describe, kv_transfer_backend, placements
from launcher.settings import ConfigError, KVBackend, ServerConfig
from launcher.supervisor import Child, ChildFailed, Supervisor
from launcher.topology import Topology
from runtime.cpu_affinity import CpuPlan, plan_cpus
from runtime.strict_spec import DetokWorkerSpec, encode_spec
from runtime.worker_spec import EngineWorkerSpec, KVTransferName
from transport.errors import TransportError
from transport.prefix_summary import summary_counters
from transport.segment import sweep_stale
from wire.roles import Role

logger = logging.getLogger("launch")

STARTUP_TIMEOUT_S = 600.0


def _model_path(config: ServerConfig) -> Path:
    """The checkpoint directory to serve; a .gguf or the default model is converted once."""
    from bundled_models.default_model import DefaultModelMissing, resolve_model
    from engine.errors import UnsupportedModelError

    if config.model is None:
        logger.info("no --model given: serving the embedded SmolLM2-135M-Instruct")
    try:
        return resolve_model(config.model)
    except (UnsupportedModelError, DefaultModelMissing) as e:
        raise ConfigError(f"--model: {e}") from e


def _engine_spec(
    config: ServerConfig,
    model: Path,
    place: WorkerPlace,
    backend: KVBackend | str | None,
    tiers: dict[str, Any],
) -> EngineWorkerSpec:
    engine = engine_config(config, model, place, tiers)
    # Prefill and decode workers: how KV moves between them; co-located workers: None.
    name = backend.value if isinstance(backend, KVBackend) else backend
    kv_transfer = None if name is None else cast(KVTransferName, name)
    remote = cluster.remote_decode(config) if place.role is Role.PREFILL else []
    node = cluster.node_name(config)  # one host too: /health names the node of each worker
    return EngineWorkerSpec(config.log_level.value, engine, kv_transfer, node, remote)


def _engine_children(
    config: ServerConfig,
    topo: Topology,
    gpus: GpuAssignment,
    model: Path,
    backend: KVBackend | str,
    first_decode: int = 0,
) -> list[Child]:
    """The engine workers of this host; on a cluster member, decode workers are numbered
    from ``first_decode`` (the cluster's numbering)."""
    cores = os.cpu_count() or 1
    num_workers = config.colocated or config.prefill + config.decode
    threads = str(max(1, cores // max(1, num_workers)))
    cpus = _cpu_plan(config, gpus)
    ucx = cluster.ucx_env(config) if config.clustered else {}
    out: list[Child] = []
    for place in placements(gpus, config.gpu_memory_utilization):
        if place.role is Role.DECODE:
            place = replace(place, index=place.index + first_decode)
        handoff = backend if place.role is not Role.COLOCATED else _workers_handoff(config)
        fields = dict(topo.kv_tier_fields)
        if topo.weights_fd is not None and place.device == "cpu":
            fields["weights_fd"] = topo.weights_fd
        spec = _engine_spec(config, model, place, handoff, fields)
        settings = encode_spec(spec)
        env = {"OMP_NUM_THREADS": threads, **ucx, **place.env()}
        if cpus is not None:
            env.update(cpus.engine_env(len(out)))
        out.append(Child(topo.spec(place.role, place.index, settings), env))
    return out


def _cpu_plan(config: ServerConfig, gpus: GpuAssignment) -> CpuPlan | None:
    """Where this host's children keep to (runtime/cpu_affinity.py): only for engine
    workers on CPU, and unless ``--cpu-affinity off``."""
    if config.cpu_affinity == "off" or not gpus.on_cpu:
        return None
    engines = config.colocated or config.prefill + config.decode
    return plan_cpus(sorted(os.sched_getaffinity(0)), engines)


def _workers_handoff(config: ServerConfig) -> KVTransferName | None:
    """A co-located worker's KV handoff: ``shm`` to the other ``--workers``, else none."""
    return "shm" if config.workers else None


def _children(
    config: ServerConfig, topo: Topology, gpus: GpuAssignment, model: Path, backend: KVBackend
) -> list[Child]:
    mcfg = ModelConfig.from_pretrained(model)
    engine = EngineConfig(model=str(model), max_model_len=config.max_model_len)
    out = _engine_children(config, topo, gpus, model, backend)
    common = encode_spec(DetokWorkerSpec(config.log_level.value, str(model)))
    cpu_only = {"OMP_NUM_THREADS": "1", **cuda_env(None)}  # frontend and shards: no GPU
    if (cpus := _cpu_plan(config, gpus)) is not None:
        cpu_only.update(cpus.rest_env())
    for k in range(config.detokenizers):
        out.append(Child(topo.spec(Role.DETOK, k, common), dict(cpu_only)))
    max_model_len = engine.resolve_max_model_len(mcfg)
    frontend = frontend_launch(config, model, mcfg, max_model_len, gpus.on_cpu).to_json()
    frontends = [
        Child(topo.spec(Role.FRONTEND, n, frontend), dict(cpu_only))
        for n in range(config.api_workers)
    ]
    if config.advertise is not None:
        layout = kv_layout(config, model, gpus)
        out.append(cluster.head_gateway(config, topo, layout, _model_name(config, model)))
    return frontends + out


def _model_name(config: ServerConfig, model: Path) -> str:
    return config.served_model_name or model.name


def _build_topology(
    config: ServerConfig, model: Path, backend: KVBackend, gpus: GpuAssignment | None = None
) -> Topology:
    topo = Topology(
        config.prefill if config.disaggregated else 0,
        config.decode + config.remote_decode if config.disaggregated else 0,
        config.detokenizers,
        num_colocated=config.colocated,
        num_frontends=config.api_workers,
        remote=cluster.head_topology_remote(config),
        handoff=config.workers > 0,
    )
    if config.enable_lora:
        topo.add_lora_table(config.max_loras)
    if config.enable_prefix_caching:
        # A GPU pool is sized by its worker, after the launcher is done: plan for many.
        assert config.kv_cache_tokens is not None, "sized by size_kv"
        on_cpu = gpus is not None and gpus.on_cpu
        blocks = -(-config.kv_cache_tokens // config.block_size) if on_cpu else None
        topo.add_prefix_summaries(summary_counters(blocks))
    if config.workers:  # --workers: any worker may hand KV to another, from its shared pool
        layout = kv_layout(config, model, gpus)
        for c in range(config.workers):
            topo.add_kv_pool(c, layout, Role.COLOCATED)
        return topo
    if config.colocated:  # no prefill/decode pools, no KV handoff: nothing more to share
        return topo
    if backend is KVBackend.CUDA_IPC:  # decode workers map the prefill GPU pools
        return topo
    # shm: per prefill worker, the segment decode workers copy from: its pool on CPU, the
    # pinned staging mirror of its GPU pool (same layout, same block ids) on GPU.
    layout = kv_layout(config, model, gpus)
    for i in range(config.prefill):
        topo.add_kv_pool(i, layout)
    return topo


def _check_port_free(host: str, port: int) -> None:
    """Fail before spawning anything if another process already listens there."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({e.strerror}); pick another --port"
            ) from e


def _http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def serve(config: ServerConfig) -> int:
    if config.clustered:
        cluster.require_extra()
    if config.join is not None:
        return serve_member(config)
    _check_port_free(config.host, config.port)
    swept = sweep_stale()
    if swept:
        logger.info("removed %d shared-memory leftovers of dead servers", len(swept))
    gpus = assign_gpus(config)
    if config.workers and not gpus.on_cpu:
        raise ConfigError(
            "--workers runs on CPU for now; on GPUs give --prefill/--decode or --colocated"
        )
    backend = kv_transfer_backend(config, gpus)
    if config.advertise is not None and backend is not KVBackend.SHM:
        raise ConfigError(
            "a head node keeps its local KV handoffs on --kv-transfer shm "
            "for now; give --kv-transfer shm with --advertise"
        )
    places = placements(gpus, config.gpu_memory_utilization)
    if not gpus.on_cpu:
        logger.info("on GPUs: %s; KV transfer: %s", describe(places), backend.value)
    model = _model_path(config)
    config = size_kv(config, model, gpus, backend)
    topo = _build_topology(config, model, backend, gpus)
    if shares_weights(config, gpus):
        topo.add_weights()
    tiers = kv_tiers.create(config, kv_layout(config, model, gpus))
    if tiers is not None:
        topo.add_kv_tier(tiers.segment, tiers.engine_fields(), tiers.frontend_fields())
    board = topo.board()
    sup = Supervisor(
        _children(config, topo, gpus, model, backend),
        topo.load_table(),
        topo.p,
        board,
        fork=config.fork_workers,
        model=str(model),
    )

    url = f"http://{config.host}:{config.port}"
    # Ready once every frontend serves (any one of them may answer the probe).
    return _supervise(
        sup,
        lambda: board.all_ready() and _http_ready(url + "/health"),
        f"pdserve is serving {model} at {url}",
        after_stop=None if tiers is None else tiers.stop,
    )


def _supervise(
    sup: Supervisor,
    ready: Callable[[], bool],
    banner: str,
    after_stop: Callable[[], None] | None = None,
) -> int:
    """Start every child, say ``banner`` once ``ready()``, then tend them until a signal."""

    def on_signal(signum: int, _frame: object) -> None:
        sup.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        sup.start_all()
        sup.wait_ready(STARTUP_TIMEOUT_S, ready)
        if not sup.stopping:
            print(f"{banner}  (Ctrl-C stops)", flush=True)
        code = sup.monitor()
    except ChildFailed as e:
        logger.error("%s", e)
        code = 1
    finally:
        sup.shutdown()
        if after_stop is not None:
            after_stop()  # e.g. flush KV tier 3, now that no worker writes tier 2
    return code


def serve_member(config: ServerConfig) -> int:
    """A node that joins a cluster: its decode workers and its gateway, no frontend."""
    swept = sweep_stale()
    if swept:
        logger.info("removed %d shared-memory leftovers of dead servers", len(swept))
    gpus = assign_gpus(config)
    model = _model_path(config)
    config = size_kv(config, model, gpus, KVBackend.SHM)
    layout = kv_layout(config, model, gpus)
    base, shape = cluster.join(config, layout, _model_name(config, model))
    mine = range(base, base + config.decode)
    topo = Topology(
        shape["prefill"],
        shape["decode"],
        shape["detok"],
        num_frontends=shape["frontends"],
        remote=cluster.member_remote(shape, mine),
    )
    if config.enable_prefix_caching:
        topo.add_prefix_summaries(summary_counters(layout.num_blocks))
    if shares_weights(config, gpus):
        topo.add_weights()
    children = _engine_children(config, topo, gpus, model, "nixl", first_decode=base)
    children.append(cluster.member_gateway(config, topo, layout, _model_name(config, model), mine))
    sup = Supervisor(children, topo.load_table(), topo.p, fork=config.fork_workers)
    return _supervise(
        sup,
        lambda: True,
        f"pdserve node {cluster.node_name(config)} serves decode workers "
        f"{list(mine)} of the cluster at {config.join}",
    )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.value.upper(),
        format="%(asctime)s pdserve:launch %(levelname)s %(name)s: %(message)s",
    )
    try:
        return serve(config)
    except (ConfigError, TransportError) as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
