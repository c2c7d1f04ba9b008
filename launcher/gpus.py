"""GPU discovery (NVML) and the assignment of workers to GPUs, decided before anything starts.

``discover_gpus`` is the only impure part: it asks NVML, and any NVML failure (library
missing, no driver, no device) means "no GPU", logged once. ``assign_gpus`` is a pure
function of the config and an inventory, so it is tested with explicit inventories.

GPU indices are NVML's, which follow PCI bus order; workers must be started with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES=<index>`` (see ``cuda_env``)
so that CUDA's device 0 in each worker is the GPU assigned here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from launcher.settings import ConfigError, Device, ServerConfig
from wire.roles import Role

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index (PCI bus order)
    name: str
    total_bytes: int
    free_bytes: int
    uuid: str = ""  # "GPU-…", as CUDA_VISIBLE_DEVICES may name it

    def describe(self) -> str:
        gib = 1 << 30
        free, total = self.free_bytes / gib, self.total_bytes / gib
        return f"GPU{self.index} {self.name} ({free:.1f}/{total:.1f} GiB free)"


@dataclass(frozen=True)
class GpuAssignment:
    """Per worker, its GPU index, or None for CPU. Tuples are indexed by worker index."""

    device: Device  # CPU or CUDA, never AUTO
    prefill: tuple[int | None, ...]
    decode: tuple[int | None, ...]
    colocated: tuple[int | None, ...]

    @property
    def on_cpu(self) -> bool:
        return self.device is Device.CPU


class GpuAssignmentError(ConfigError):
    """The GPUs found cannot host the workers asked for; raised before anything starts."""


def discover_gpus() -> tuple[GpuInfo, ...]:
    """The NVIDIA GPUs this launch may use, in index order; () when NVML is absent or fails.

    NVML lists every GPU of the host; a ``CUDA_VISIBLE_DEVICES`` given to ``launch``
    narrows that down (``visible_subset``).
    """
    found = _nvml_gpus()
    return visible_subset(found, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_subset(gpus: Sequence[GpuInfo], visible: str | None) -> tuple[GpuInfo, ...]:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value names, in its order (None: all of them).

    Entries are indices, taken in PCI bus order as the workers' ``CUDA_DEVICE_ORDER`` is,
    or ``GPU-`` UUIDs (or unique prefixes of them). MIG instances are refused: a worker
    is given a whole GPU. An entry that names no GPU ends the list, as it does for CUDA.
    """
    if visible is None:
        return tuple(gpus)
    out: list[GpuInfo] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith("MIG-"):
            raise GpuAssignmentError(
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); pdserve gives each "
                "worker whole GPUs: name GPUs, or unset it and use --prefill-gpus/--decode-gpus"
            )
        if entry.isdigit():
            match = [g for g in gpus if g.index == int(entry)]
        else:
            match = [g for g in gpus if g.uuid and g.uuid.startswith(entry)] if entry else []
        if len(match) != 1:
            if entry:
                logger.warning(
                    "CUDA_VISIBLE_DEVICES entry %r names no single GPU; the GPUs "
                    "after it are not used",
                    entry,
                )
            break
        if match[0] not in out:
            out.append(match[0])
    return tuple(sorted(out, key=lambda g: g.index))


def _nvml_gpus() -> tuple[GpuInfo, ...]:
    """Every NVIDIA GPU NVML sees, in index order; () when NVML is absent or fails."""
    try:
        import pynvml
    except ImportError:
        logger.info("pynvml is not installed: no GPU discovery, running on CPU")
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        logger.info("NVML unavailable (%s): running on CPU", e)
        return ()
    try:
        return tuple(_query(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount()))
    except pynvml.NVMLError as e:
        logger.warning("NVML failed while listing GPUs (%s): running on CPU", e)
        return ()
    finally:
        pynvml.nvmlShutdown()


def _query(nvml: ModuleType, i: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(i)
    name = nvml.nvmlDeviceGetName(handle)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    if isinstance(name, bytes):  # older bindings return bytes
        name = name.decode()
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    return GpuInfo(
        index=i,
        name=str(name),
        total_bytes=int(mem.total),
        free_bytes=int(mem.free),
        uuid=str(uuid),
    )


def assign_gpus(config: ServerConfig, inventory: Sequence[GpuInfo] | None = None) -> GpuAssignment:
    """Decide where every worker runs. ``inventory=None`` asks NVML.

    Prefill workers take the first N GPUs and decode workers the next M, unless
    ``--prefill-gpus``/``--decode-gpus`` name them; GPUs are shared between workers only
    when those lists say so. Raises ``GpuAssignmentError`` naming what was found and asked.
    """
    if config.device is Device.CPU:
        return _all_cpu(config)
    gpus = tuple(discover_gpus() if inventory is None else inventory)
    if not gpus:
        if config.device is Device.CUDA or config.prefill_gpus or config.decode_gpus:
            raise GpuAssignmentError(
                "no NVIDIA GPU found (NVML lists none) but --device cuda or a GPU list was "
                "given; use --device cpu or check the driver with nvidia-smi"
            )
        return _all_cpu(config)
    found = {g.index: g for g in gpus}
    if config.colocated:
        colocated = _default_slice(config.colocated, (), found, Role.COLOCATED)
        _warn_busy(found, colocated, config.gpu_memory_utilization)
        return GpuAssignment(Device.CUDA, (), (), tuple(colocated))
    prefill = config.prefill_gpus or _default_slice(
        config.prefill, config.decode_gpus or (), found, Role.PREFILL
    )
    decode = config.decode_gpus or _default_slice(config.decode, prefill, found, Role.DECODE)
    _check_exist(prefill, found, "--prefill-gpus")
    _check_exist(decode, found, "--decode-gpus")
    _warn_busy(found, (*prefill, *decode), config.gpu_memory_utilization)
    return GpuAssignment(Device.CUDA, tuple(prefill), tuple(decode), ())


def cuda_env(gpu: int | None) -> dict[str, str]:
    """Environment for a worker process: it sees only its GPU, as CUDA device 0."""
    if gpu is None:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu)}


def _all_cpu(config: ServerConfig) -> GpuAssignment:
    if config.colocated:
        return GpuAssignment(Device.CPU, (), (), (None,) * config.colocated)
    return GpuAssignment(Device.CPU, (None,) * config.prefill, (None,) * config.decode, ())


def _default_slice(
    count: int, taken: Sequence[int], found: dict[int, GpuInfo], role: Role
) -> tuple[int, ...]:
    """The first ``count`` GPUs not already taken by the other role."""
    free = [i for i in sorted(found) if i not in set(taken)]
    if len(free) < count:
        listing = ", ".join(g.describe() for g in found.values())
        raise GpuAssignmentError(
            f"{count} {role} worker(s) need {count} more GPU(s), but {len(free)} of the "
            f"{len(found)} found are left ({listing}); lower the worker counts, share GPUs "
            f"explicitly with --prefill-gpus/--decode-gpus, or use --device cpu"
        )
    return tuple(free[:count])


def _check_exist(ids: Sequence[int], found: dict[int, GpuInfo], flag: str) -> None:
    missing = sorted(set(ids) - set(found))
    if missing:
        raise GpuAssignmentError(
            f"{flag} names GPU(s) {missing}, but only {sorted(found)} exist "
            f"({', '.join(g.describe() for g in found.values())})"
        )


def _warn_busy(found: dict[int, GpuInfo], used: Sequence[int], utilization: float) -> None:
    """Another process holding memory makes the worker's budget fail later; say so now."""
    for i in sorted(set(used)):
        g = found[i]
        if g.free_bytes < utilization * g.total_bytes:
            logger.warning(
                "%s has less free memory than --gpu-memory-utilization %.2f asks for",
                g.describe(),
                utilization,
            )
