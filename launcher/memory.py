"""Host memory admission: a server whose KV pools and weights cannot fit in the RAM this
process may use is refused before anything is created or spawned.

Why RAM and not /dev/shm: tmpfs is sized independently of memory (by default half of RAM,
in containers whatever ``--shm-size`` says, often more than the cgroup allows), and decode
workers' pools on CPU are private memory, not in /dev/shm at all. A KV size that passed the
/dev/shm check but not RAM got the decode worker killed by the OOM killer during startup,
and all the operator saw was ``exited during startup (code -9)``.

What may be used is the smaller of ``MemAvailable`` (/proc/meminfo: free memory plus what
the kernel can reclaim without swapping) and, under a cgroup memory limit (v2
``memory.max``, v1 ``memory.limit_in_bytes``, at this process's cgroup and every ancestor),
the limit minus the cgroup's working set (usage less its inactive file cache, which the
kernel reclaims before it OOM-kills; the same working set ``docker stats`` and the kubelet
use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from launcher.args import ConfigError, KVTransfer, ServerConfig
from transport.kv import KVLayout

GiB = 1 << 30
# NOTE: a worker process on CPU holds ~300 MiB beyond its weights and KV (torch, the model
# code, activations of a small batch); counted conservatively so that a budget that fits
# only on paper is refused too.
PROCESS_BASELINE_BYTES = 200 << 20
_V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process tree may still allocate, and where that bound comes from."""

    available: int
    source: str


@dataclass(frozen=True)
class MemoryNeed:
    """Host memory a server will hold: KV pools, weight copies and worker processes."""

    kv_pool_bytes: int  # one pool
    kv_pools: int  # pools held in host memory (CPU pools, or pinned shm staging mirrors)
    kv_bytes_per_token: int
    weight_bytes: int  # one copy of the weights
    weight_copies: int  # workers holding their weights in host memory (CPU workers)
    processes: int

    @property
    def total(self) -> int:
        return (
            self.kv_pools * self.kv_pool_bytes
            + self.weight_copies * self.weight_bytes
            + self.processes * PROCESS_BASELINE_BYTES
        )


def meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_available(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> tuple[int, str] | None:
    """The tightest (limit - working set) over this process's memory cgroup and its
    ancestors, with the file that set it; None when no memory limit applies."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            found = _walk(root, path, _v2_level)
        elif "memory" in controllers.split(","):
            found = _walk(root / "memory", path, _v1_level)
        else:
            continue
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


_Level = Callable[[Path], "tuple[int, str] | None"]


def _walk(base: Path, path: str, level: _Level) -> tuple[int, str] | None:
    """Visit the cgroup's directory and its ancestors up to ``base`` (a namespaced mount
    shows the cgroup at ``base`` itself, not under its host path)."""
    here = base / path.strip("/")
    if not here.is_dir():
        here = base
    best: tuple[int, str] | None = None
    while True:
        found = level(here)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
        if here == base or base not in here.parents:
            return best
        here = here.parent


def _v2_level(d: Path) -> tuple[int, str] | None:
    limit = _read(d / "memory.max")
    current = _read(d / "memory.current")
    if limit is None or limit == "max" or current is None:
        return None
    used = int(current) - _stat(d / "memory.stat", "inactive_file")
    return int(limit) - max(used, 0), str(d / "memory.max")


def _v1_level(d: Path) -> tuple[int, str] | None:
    limit = _read(d / "memory.limit_in_bytes")
    usage = _read(d / "memory.usage_in_bytes")
    if limit is None or usage is None or int(limit) >= _V1_UNLIMITED:
        return None
    used = int(usage) - _stat(d / "memory.stat", "total_inactive_file")
    return int(limit) - max(used, 0), str(d / "memory.limit_in_bytes")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def host_memory() -> HostMemory:
    available = meminfo_available()
    mem = HostMemory(available, "MemAvailable in /proc/meminfo") if available is not None else None
    limited = cgroup_available()
    if limited is not None and (mem is None or limited[0] < mem.available):
        mem = HostMemory(max(limited[0], 0), f"the cgroup memory limit ({limited[1]})")
    # No /proc (not Linux): nothing to measure against, so nothing is refused.
    return mem or HostMemory(1 << 62, "unknown")


def weight_nbytes(m: ModelConfig, dtype: torch.dtype) -> int:
    """Parameters of a Llama-family model, times the element size."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attn = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    if m.qkv_bias:
        attn += q + 2 * kv
    if m.qk_norm:
        attn += 2 * m.head_dim
    layer = attn + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    params = embed + m.num_layers * layer + m.hidden_size
    return params * dtype.itemsize


def memory_need(
    config: ServerConfig, m: ModelConfig, dtype: torch.dtype, on_cpu: bool, backend: KVTransfer
) -> MemoryNeed:
    """What ``config`` holds in host memory: on CPU every worker's pool and weights (a
    prefill worker's pool is its shm segment, a decode worker's is private); on GPU only
    the pinned staging mirrors of ``--kv-transfer shm``."""
    layout = KVLayout(
        num_blocks=-(-config.kv_cache_tokens // config.block_size),
        num_layers=m.num_layers, block_size=config.block_size, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    workers = config.colocated or config.prefill + config.decode
    if on_cpu:
        pools, copies = workers, workers
    else:
        pools = config.prefill if config.disaggregated and backend is KVTransfer.SHM else 0
        copies = 0
    return MemoryNeed(
        kv_pool_bytes=layout.nbytes,
        kv_pools=pools,
        kv_bytes_per_token=layout.block_nbytes // config.block_size,
        weight_bytes=weight_nbytes(m, dtype),
        weight_copies=copies,
        processes=workers + config.detokenizers + 1,  # and the frontend
    )


def check_host_memory(config: ServerConfig, need: MemoryNeed, mem: HostMemory) -> None:
    """Raise ``ConfigError`` saying what to lower when ``need`` exceeds ``mem``."""
    if need.total <= mem.available:
        return
    rest = need.total - need.kv_pools * need.kv_pool_bytes
    fit = (mem.available - rest) // max(1, need.kv_pools * need.kv_bytes_per_token)
    fit -= fit % config.block_size
    where = "per worker" if need.weight_copies else "per prefill worker (pinned staging mirror)"
    advice = (
        f"lower --kv-cache-tokens (at most ~{fit} would fit)"
        if fit >= config.block_size
        else "run fewer --prefill/--decode workers or use a smaller model"
    )
    raise ConfigError(
        f"not enough host memory: the server needs ~{need.total / GiB:.1f} GiB "
        f"({need.kv_pools} KV pools of {need.kv_pool_bytes / GiB:.1f} GiB: --kv-cache-tokens "
        f"{config.kv_cache_tokens} {where}; {need.weight_copies} copies of "
        f"{need.weight_bytes / GiB:.2f} GiB of weights; {need.processes} processes), but only "
        f"{mem.available / GiB:.1f} GiB is available ({mem.source}); {advice}"
    )
