"""Host memory for the KV cache: a byte budget, checked before anything is spawned.

On CPU every engine worker holds a model replica and a KV pool in host memory, and so does
the staging mirror of a GPU prefill worker. The KV size is a byte budget per pool
(``--kv-cache-memory`` GiB, as vLLM's ``VLLM_CPU_KVCACHE_SPACE``), or by default a share
of the memory the machine can give now:

    usable   = min(MemAvailable, cgroup limit - cgroup usage) * USABLE_FRACTION
    fixed    = engines * (weights + ENGINE_OVERHEAD + activations) + others * AUX_OVERHEAD
    per pool = min(DEFAULT_KV_CAP, (usable - fixed) / pools)

Pools are not zero-filled: pages are committed as tokens are written, so a large budget
costs address space, not resident memory, until it is used. The budget is still checked
against what the machine has, so that a full pool can never push a worker into the OOM
killer. ``--kv-cache-tokens`` overrides the budget with a token count.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
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
    available_bytes: int
    weight_bytes: int  # one replica, in the serving dtype

    def describe(self, pools: int) -> str:
        return (f"KV cache: {self.bytes_per_pool / GIB:.2f} GiB = {self.tokens_per_pool} tokens "
                f"per pool x {pools} pools; weights {self.weight_bytes / GIB:.2f} GiB per "
                f"replica; {self.available_bytes / GIB:.1f} GiB available")  # fmt: skip


def available_bytes() -> int:
    """What this process could still allocate: MemAvailable, bounded by a cgroup limit."""
    meminfo = Path("/proc/meminfo").read_text()
    avail = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                 if line.startswith("MemAvailable:"))  # fmt: skip
    limit = _cgroup_room()
    return avail if limit is None else min(avail, limit)


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1); None if none."""
    v2 = Path("/sys/fs/cgroup")
    for limit_file, usage_file in (
        (v2 / "memory.max", v2 / "memory.current"),
        (v2 / "memory" / "memory.limit_in_bytes", v2 / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 says "no limit" so
            return None
        return max(0, int(limit_text) - usage)
    return None


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of one replica's weights in ``dtype``, from the safetensors headers alone.

    Raises ``ValueError`` naming a file that is not safetensors.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            try:
                if not 0 < n <= size - 8:
                    raise ValueError("header length out of range")
                header = json.loads(f.read(n))
                shapes = [entry["shape"] for name, entry in header.items()
                          if name != "__metadata__"]  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} is not a safetensors file ({e})") from e
        for shape in shapes:
            count = 1
            for dim in shape:
                count *= dim
            numel += count
    return numel * itemsize


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


def plan_kv(
    m: ModelConfig, weights: int, dtype: torch.dtype, demand: Demand,
    kv_cache_memory_gib: float | None = None, kv_cache_tokens: int | None = None,
    available: int | None = None,
) -> KVPlan:  # fmt: skip
    """Tokens per KV pool, or ``MemoryBudgetError`` before anything is spawned."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = kv_bytes_per_token(m, itemsize)
    available = available_bytes() if available is None else available
    usable = int(available * USABLE_FRACTION)
    activations = activation_bytes(m, min(demand.chunk, demand.max_model_len), itemsize)
    fixed = demand.engines * (weights + ENGINE_OVERHEAD + activations)
    fixed += demand.others * AUX_OVERHEAD
    room = usable - fixed
    pools = max(demand.pools, 1)
    if kv_cache_tokens is not None:
        want, flag = kv_cache_tokens * per_token, f"--kv-cache-tokens {kv_cache_tokens}"
    elif kv_cache_memory_gib is not None:
        want, flag = int(kv_cache_memory_gib * GIB), f"--kv-cache-memory {kv_cache_memory_gib:g}"
    else:
        want, flag = min(DEFAULT_KV_CAP, room // pools), ""
    need_one = per_token * demand.max_model_len  # one longest sequence must fit a pool
    what = (f"{demand.engines} model replicas of {weights / GIB:.2f} GiB and "
            f"{demand.pools} KV pools need more than the {available / GIB:.1f} GiB this "
            "machine has available")  # fmt: skip
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
    return KVPlan(tokens, tokens * per_token, available, weights)
