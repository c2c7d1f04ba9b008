"""Host memory for the KV cache: a byte budget, checked before anything is spawned.

On CPU every engine worker holds a model replica and a KV pool in host memory, and so does
the staging mirror of a GPU prefill worker. The KV size is a byte budget per pool
(``--kv-cache-memory`` GiB, as vLLM's ``VLLM_CPU_KVCACHE_SPACE``), or by default a share
of the memory the machine can give now:

    usable   = min(MemAvailable, cgroup limit - cgroup working set) * USABLE_FRACTION
    fixed    = engines * (private weights + ENGINE_OVERHEAD + activations)
             + others * AUX_OVERHEAD + the host's KV tier 2 (--kv-offload-memory)
             + the weights CPU workers share, once (engine/checkpoint/shared_weights.py)
    per pool = min(DEFAULT_KV_CAP, (usable - fixed) / pools)

Pools are not zero-filled: pages are committed as tokens are written, so a large budget
costs address space, not resident memory, until it is used. The budget is still checked
against what the machine has, so that a full pool can never push a worker into the OOM
killer. ``--kv-cache-tokens`` overrides the budget with a token count.

Why RAM and not /dev/shm: tmpfs is sized independently of memory (by default half of RAM,
in containers whatever ``--shm-size`` says, often more than the cgroup allows), and decode
workers' pools on CPU are private memory, not in /dev/shm at all. What may be used is the
smaller of ``MemAvailable`` (free memory plus what the kernel can reclaim without
swapping) and, under a cgroup memory limit (v2 ``memory.max``, v1
``memory.limit_in_bytes``, at this process's cgroup and every ancestor), the limit minus
the cgroup's working set (usage less its inactive file cache, which the kernel reclaims
before it OOM-kills; the working set ``docker stats`` and the kubelet use).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import ModelConfig
from wire.kv_layout import ITEMSIZE

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
_V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX
USABLE_FRACTION = 0.9  # leave the rest to the OS and whatever else runs here
DEFAULT_KV_CAP = 4 * GIB  # vLLM's CPU default; enough for ~90k tokens of a 135M model
ENGINE_OVERHEAD = 600 * MIB  # interpreter, torch, tokenizer: a worker's RSS before weights
AUX_OVERHEAD = 400 * MIB  # frontend, each detokenizer shard


class MemoryBudgetError(ValueError):
    """The machine cannot hold the workers asked for; the message says what to lower."""


@dataclass(frozen=True)
class KVPlan:
    tokens_per_pool: int
    bytes_per_pool: int
    memory: HostMemory
    weight_bytes: int  # one replica's private weights, in the serving dtype
    shared_weight_bytes: int = 0  # held once per host, mapped by every CPU worker

    def describe(self, pools: int) -> str:
        shared = (
            f" + {self.shared_weight_bytes / GIB:.2f} GiB shared once by all"
            if self.shared_weight_bytes
            else ""
        )
        return (
            f"KV cache: {self.bytes_per_pool / GIB:.2f} GiB = {self.tokens_per_pool} tokens "
            f"per pool x {pools} pools; weights {self.weight_bytes / GIB:.2f} GiB per "
            f"replica{shared}; {self.memory.available / GIB:.1f} GiB available "
            f"({self.memory.source})"
        )


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process tree may still allocate, and where that bound comes from."""

    available: int
    source: str


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
    """What this process tree may still allocate: MemAvailable, or a tighter cgroup room."""
    available = meminfo_available()
    mem = HostMemory(available, "MemAvailable in /proc/meminfo") if available is not None else None
    limited = cgroup_available()
    if limited is not None and (mem is None or limited[0] < mem.available):
        mem = HostMemory(max(limited[0], 0), f"the cgroup memory limit ({limited[1]})")
    # No /proc (not Linux): nothing to measure against, so nothing is refused.
    return mem or HostMemory(1 << 62, "unknown")


_ITEMSIZES = {**ITEMSIZE, "int8": 1}  # KV dtypes, and packed weights' bytes


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of a dtype the engine stores, given as a torch dtype or by name
    (the launcher plans by name: it does not import torch)."""
    return _ITEMSIZES[str(dtype).removeprefix("torch.")]


def weight_bytes(model_dir: Path, dtype: torch.dtype | str) -> int:
    """Bytes of one replica's weights in ``dtype``, from the safetensors headers alone.

    Raises ``ValueError`` naming a file that is not safetensors.
    """
    numel = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            try:
                if not 0 < n <= size - 8:
                    raise ValueError("header length out of range")
                header = json.loads(f.read(n))
                shapes = [
                    entry["shape"] for name, entry in header.items() if name != "__metadata__"
                ]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} is not a safetensors file ({e})") from e
        for shape in shapes:
            count = 1
            for dim in shape:
                count *= dim
            numel += count
    return numel * itemsize(dtype)


def activation_bytes(m: ModelConfig, chunk: int, itemsize: int) -> int:
    """A generous peak of one prefill chunk's activations: hidden states, MLP, scores."""
    per_token = 8 * m.hidden_size + 3 * m.intermediate_size + m.num_heads * chunk
    return chunk * per_token * itemsize + m.vocab_size * 4 * 64  # + a few rows of logits


def kv_bytes_per_token(m: ModelConfig, itemsize: int) -> int:
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * itemsize


@dataclass(frozen=True)
class Demand:
    """What the server will hold in host memory, apart from KV pools."""

    engines: int  # processes with a model replica in host memory (CPU workers)
    others: int  # frontend + detokenizer shards
    pools: int  # KV pools in host memory (CPU pools, GPU staging mirrors)
    chunk: int  # --chunked-prefill-size
    max_model_len: int
    offload: int = 0  # bytes of the host's KV tier 2 (launcher/kv_tiers.py)
    shared_weights: int = 0  # bytes of weights held once per host, not per engine


def plan_kv(
    m: ModelConfig,
    weights: int,
    dtype: torch.dtype | str,
    demand: Demand,
    kv_cache_memory_gib: float | None = None,
    kv_cache_tokens: int | None = None,
    memory: HostMemory | None = None,
) -> KVPlan:
    """Tokens per KV pool, or ``MemoryBudgetError`` before anything is spawned."""
    size = itemsize(dtype)
    per_token = kv_bytes_per_token(m, size)
    memory = host_memory() if memory is None else memory
    available = memory.available
    usable = int(available * USABLE_FRACTION)
    activations = activation_bytes(m, min(demand.chunk, demand.max_model_len), size)
    fixed = demand.engines * (weights + ENGINE_OVERHEAD + activations)
    fixed += demand.others * AUX_OVERHEAD + demand.offload + demand.shared_weights
    room = usable - fixed
    pools = max(demand.pools, 1)
    if kv_cache_tokens is not None:
        want, flag = kv_cache_tokens * per_token, f"--kv-cache-tokens {kv_cache_tokens}"
    elif kv_cache_memory_gib is not None:
        want, flag = int(kv_cache_memory_gib * GIB), f"--kv-cache-memory {kv_cache_memory_gib:g}"
    else:
        want, flag = min(DEFAULT_KV_CAP, room // pools), ""
    need_one = per_token * demand.max_model_len  # one longest sequence must fit a pool
    shared = f" (+ {demand.shared_weights / GIB:.2f} GiB shared)" if demand.shared_weights else ""
    what = (
        f"{demand.engines} model replicas of {weights / GIB:.2f} GiB{shared} and "
        f"{demand.pools} KV pools need more than the {available / GIB:.1f} GiB available "
        f"({memory.source})"
    )
    if flag and want * pools > room:
        raise MemoryBudgetError(
            f"{flag}: {what} ({want * pools / GIB:.2f} GiB of KV on top of "
            f"{fixed / GIB:.2f} GiB for the workers): lower it, or the number of workers"
        )
    if not flag and want < need_one:
        raise MemoryBudgetError(
            f"{what} (a pool must hold one --max-model-len {demand.max_model_len} sequence, "
            f"{need_one / GIB:.2f} GiB): lower --prefill/--decode, --max-model-len, or "
            "free memory"
        )
    tokens = max(want // per_token, 1)
    return KVPlan(tokens, tokens * per_token, memory, weights, demand.shared_weights)
