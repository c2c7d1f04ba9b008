"""What each worker is told about where it runs: device, environment, GPU memory share,
and the KV transfer backend. Pure functions of the config and a ``GpuAssignment``, so
they are tested with explicit assignments (no NVML, no GPU).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from launcher.gpus import GpuAssignment, cuda_env
from launcher.settings import ConfigError, KVBackend, ServerConfig
from wire.roles import ENGINE_ROLES, Role


@dataclass(frozen=True)
class WorkerPlace:
    """One worker's place: ``gpu`` is the NVML index (None on CPU)."""

    role: Role
    index: int
    gpu: int | None
    gpu_memory_share: float | None  # fraction of the GPU's total memory; None on CPU

    @property
    def device(self) -> str:
        # The worker sees only its GPU (cuda_env), as CUDA device 0.
        return "cpu" if self.gpu is None else "cuda"

    def env(self) -> dict[str, str]:
        return cuda_env(self.gpu)


def kv_transfer_backend(config: ServerConfig, gpus: GpuAssignment) -> KVBackend:
    """The backend in use (never AUTO): cuda_ipc on GPUs and shm on CPU, unless given."""
    if gpus.on_cpu:
        if config.kv_transfer is KVBackend.CUDA_IPC:
            raise ConfigError(
                "--kv-transfer cuda_ipc needs GPUs, but the workers run on CPU (no NVIDIA "
                "GPU found, or --device cpu); use --kv-transfer shm or auto"
            )
        return KVBackend.SHM
    return KVBackend.CUDA_IPC if config.kv_transfer is KVBackend.AUTO else config.kv_transfer


def placements(gpus: GpuAssignment, utilization: float) -> list[WorkerPlace]:
    """Every worker's placement, prefill then decode then co-located, by index.

    ``utilization`` is the fraction of a GPU's total memory that all pdserve workers on it
    may use together; each of the ``n`` workers on one GPU gets ``utilization / n``.
    """
    pools = (gpus.prefill, gpus.decode, gpus.colocated)
    per_gpu = Counter(g for pool in pools for g in pool if g is not None)
    return [
        WorkerPlace(role, index, gpu, None if gpu is None else utilization / per_gpu[gpu])
        for role, pool in zip(ENGINE_ROLES, pools, strict=True)
        for index, gpu in enumerate(pool)
    ]


def describe(places: list[WorkerPlace]) -> str:
    """One line for the launch log: where each worker runs and its memory share."""
    return ", ".join(
        f"{p.role.worker_name(p.index)}: "
        + ("CPU" if p.gpu is None else f"GPU{p.gpu} ({p.gpu_memory_share:.0%} of memory)")
        for p in places
    )
