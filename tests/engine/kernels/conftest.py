"""Kernel tests run on CUDA where there is one, else on CPU under the Triton interpreter.

``TRITON_INTERPRET`` is read when a kernel is *defined* (``@triton.jit``, triton's own
helpers included), and again by triton when it first launches one, so it is set while
the kernel modules are imported here (before any test can import them) and during each
test of this directory (``interpret``, autouse), and restored in between: nothing the
rest of the suite starts (launched servers) inherits it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest
import torch

KERNEL_MODULES = (
    "engine.cuda.kernels.decode_attention",
    "engine.cuda.kernels.extend_attention",
    "engine.cuda.kernels.fused_ops",
    "engine.cuda.kernels.rope_store",
    "engine.cuda.kernels.backend",
    "engine.cuda.kernels.lora",
    "engine.cuda.lora_bank",
    "engine.cuda.kernel_path",
)
INTERPRET = not torch.cuda.is_available()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]  # the kernel path needs triton; CPU serving does not
elif INTERPRET:
    imported = [m for m in (*KERNEL_MODULES, "triton") if m in sys.modules]
    # triton's own helpers (tl.cdiv ...) are defined when triton is imported: imported
    # before this, by a test module's top level, they do not run under the interpreter.
    assert not imported, f"{imported} were imported before TRITON_INTERPRET was set"
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _module in KERNEL_MODULES:
            importlib.import_module(_module)
    finally:
        if _before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton reads the variable at launch; the runner reads it to allow the CPU backend."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def random_pool(
    num_blocks: int,
    layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A pool of the engine's layout filled with N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layers, 2, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=DEVICE)


def random_tables(ctx_lens: list[int], block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    """(B, W) int32 block tables of distinct shuffled blocks, W = the most any needs + 1."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in ctx_lens) + 1
    assert len(ctx_lens) * width <= num_blocks
    perm = torch.randperm(num_blocks, generator=g)[: len(ctx_lens) * width]
    return perm.view(len(ctx_lens), width).to(device=DEVICE, dtype=torch.int32)
