"""The bfloat16 GEMMs packed layers switch to for many rows, and the crossover between them.

Each GEMM holds the same de-quantized weights as the packed kernel; both are checked
against the float32 product of those weights. The crossover is a measurement of this
machine: the tests check that it is measured once, cached, and re-measured only when the
cache cannot be read, never which value it takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.weights import gemm as gemm_module
from engine.weights.gemm import (
    NEVER,
    PlainGemm,
    PrepackedGemm,
    bf16_gemm,
    min_gemm_rows,
    prepacked_supported,
)
from engine.weights.linear import packed_kernel
from engine.weights.quant import quantize_int4, quantize_int8

CPU = torch.device("cpu")
needs_prepack = pytest.mark.skipif(
    not prepacked_supported(), reason="this CPU's oneDNN has no bfloat16 GEMM"
)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("rows", [1, 5, 33, 256])
@pytest.mark.parametrize(
    "make",
    [PlainGemm, pytest.param(PrepackedGemm, marks=needs_prepack)],
    ids=["plain", "prepacked"],
)
def test_each_gemm_equals_the_float32_product_of_the_same_weights(make: type, rows: int) -> None:
    """Stated tolerance: 1e-2 relative (bfloat16 activations and outputs, exact weights)."""
    torch.manual_seed(rows)
    q = quantize_int4(torch.randn(96, 128))
    w = q.dequantize()
    x = torch.randn(rows, 128)
    exact = x @ w.T
    got = make(w)(x)
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert _rel(got, exact) < 1e-2
    packed = packed_kernel(q, torch.bfloat16, CPU)(x, None)
    assert _rel(packed, exact) < 1e-2  # the packed kernel, on the same weights


@needs_prepack
def test_the_prepacked_gemm_agrees_with_the_plain_one() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(64, 96), torch.randn(40, 96)
    assert _rel(PrepackedGemm(w)(x), PlainGemm(w)(x).float()) < 1e-2


def test_bf16_gemm_takes_the_prepacked_route_only_where_onednn_computes_bf16() -> None:
    w = torch.randn(16, 32)
    assert isinstance(bf16_gemm(w, prepack=False), PlainGemm)
    want = PrepackedGemm if prepacked_supported() else PlainGemm
    assert isinstance(bf16_gemm(w), want)


def test_the_crossover_is_measured_once_per_machine_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    q = quantize_int8(torch.randn(48, 64))
    packed, gemm = packed_kernel(q, torch.bfloat16, CPU), PlainGemm(q.dequantize())
    calls = {"packed": 0, "gemm": 0}

    def counted(name: str, fn: torch.nn.Module) -> object:
        def run(x: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            return fn(x, None) if name == "packed" else fn(x)

        return run

    first = min_gemm_rows(counted("packed", packed), counted("gemm", gemm), (48, 64), "t")  # type: ignore[arg-type]
    assert first in gemm_module._CANDIDATES or first == NEVER
    assert calls["packed"] > 0 and calls["gemm"] > 0
    [cached] = list((tmp_path / "kernels").glob("*.json"))
    assert json.loads(cached.read_text())["min_rows"] == first
    seen = dict(calls)
    again = min_gemm_rows(counted("packed", packed), counted("gemm", gemm), (48, 64), "t")  # type: ignore[arg-type]
    assert again == first and calls == seen  # read back, not measured
    cached.write_text("{not json")
    min_gemm_rows(counted("packed", packed), counted("gemm", gemm), (48, 64), "t")  # type: ignore[arg-type]
    assert calls["packed"] > seen["packed"]  # an unreadable cache is measured again
    assert json.loads(cached.read_text())["min_rows"] in (*gemm_module._CANDIDATES, NEVER)
    assert not list((tmp_path / "kernels").glob("*.tmp"))
