"""pdserve's CPU kernel library (``engine/kernels/cpu/``): one build of every file, found
beside its loader, registering each op the engine calls; refused, with a reason, where the
CPU cannot run it. The ops' numbers are pinned where they are used: the int4 products in
tests/engine/test_int4_tiles.py, the rest in tests/engine/test_fused_cpu.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import ops

OPS = (
    "int4_mm",
    "int4_gemm",
    "int4_gemm_a8",
    "silu_mul",
    "rope_store",
    "decode_attention",
    "prefill_attention",
)


@pytest.fixture
def fresh_load() -> Iterator[None]:
    """``ops.load`` remembers its outcome a process; each test here starts it afresh."""
    ops.load.cache_clear()
    yield
    ops.load.cache_clear()


def test_the_library_is_one_build_beside_its_loader() -> None:
    path = ops.library_path()
    if path is None:
        pytest.skip("pdserve's CPU kernels are not built here")
    assert path.parent == Path(ops.__file__).parent
    assert path.name.startswith("_kernels")
    sources = sorted([*path.parent.glob("*.cpp"), *path.parent.glob("*.h")])
    assert len(sources) > 1  # split by family, built as one library
    # A build older than a source would serve stale code.
    assert all(path.stat().st_mtime >= s.stat().st_mtime for s in sources), "rebuild it"


def test_every_op_is_registered(fresh_load: None) -> None:
    if ops.library_path() is None or not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    ops.load()
    for name in OPS:
        assert hasattr(torch.ops.pdserve, name), name
    assert ops.op("silu_mul") is torch.ops.pdserve.silu_mul
    assert ops.decode_attention_op() is torch.ops.pdserve.decode_attention


def test_refused_without_avx512_bf16(monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(ops.CpuOpsUnavailable, match="AVX-512 BF16"):
        ops.load()
    assert ops.silu_mul_op() is None
    assert ops.prefill_attention_op() is None


def test_refused_when_not_built(monkeypatch: pytest.MonkeyPatch, fresh_load: None) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(ops, "library_path", lambda: None)
    with pytest.raises(ops.CpuOpsUnavailable, match="make setup"):
        ops.load()
    assert ops.rope_store_op() is None
