"""Triton kernels for the CUDA path: attention that reads the paged KV pool in place, and
the small fused ops around it (add + RMSNorm, rotary + KV store, SiLU * up).

Every kernel has a host wrapper in the module that defines it; the wrappers take torch
tensors and launch on whatever device the tensors live on. On CPU they run only under the
Triton interpreter (``TRITON_INTERPRET=1`` when the module is first imported), which is
how the tests check them against the torch reference in ``engine/model/attention.py``.

Pool layout, shared by all of them (engine/kv/kv_cache.py): ``(num_blocks, num_layers, 2,
block_size, num_kv_heads, head_dim)``, K at index 0 of axis 2, V at 1. Token ``t`` of a
sequence is at ``block_table[t // block_size]``, slot ``t % block_size``. Block tables are
rows of one persistent ``(rows, max_blocks)`` int32 table; a batch names its rows by index
(``seq_rows``), so no per-step table is built.

The ``@triton.jit`` kernels themselves carry ``# type: ignore[no-untyped-def]``: their
parameters are pointers and launch constants, which Python annotations cannot describe.

Nothing here is imported unless the kernel path is chosen: importing ``triton`` is slow
and optional (``triton_available``).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.config import ATTENTION_BACKENDS


def triton_available() -> bool:
    """True when ``triton`` can be imported (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: exact for float32 (the
    tests compare against the torch reference), TF32 tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def use_kernels(backend: str, device_type: str) -> bool:
    """Whether a runner on ``device_type`` takes the kernel path for ``backend``.

    ``auto``: on CUDA (Ampere or newer) when triton imports; ``torch``: never (SDPA over
    gathered blocks); ``triton``: always, which on CPU works only under the Triton
    interpreter (the tests).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, not {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        # NOTE: Ampere or newer: what the kernels' 16-bit tl.dot tiles are written for
        # (older GPUs have no bfloat16 tensor cores); older ones keep the torch path.
        return (
            device_type == "cuda"
            and triton_available()
            and torch.cuda.get_device_capability() >= (8, 0)
        )
    if not triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton kernels run on CPU only under TRITON_INTERPRET=1 (tests)")
    return True
