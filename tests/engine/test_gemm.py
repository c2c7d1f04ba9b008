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
    VnniGemm,
    bf16_gemm,
    min_gemm_rows,
    prepacked_supported,
    vnni_supported,
)
from engine.weights.linear import packed_kernel
from engine.weights.quant import quantize_int4, quantize_int8

CPU = torch.device("cpu")
needs_prepack = pytest.mark.skipif(
    not prepacked_supported(), reason="this CPU's oneDNN has no bfloat16 GEMM"
)
needs_vnni = pytest.mark.skipif(
    not vnni_supported(), reason="the kernel library's bfloat16 GEMM does not load here"
)
GEMMS = [
    PlainGemm,
    pytest.param(PrepackedGemm, marks=needs_prepack),
    pytest.param(VnniGemm, marks=needs_vnni),
]
GEMM_IDS = ["plain", "prepacked", "vnni"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("rows", [1, 5, 33, 256])
@pytest.mark.parametrize("make", GEMMS, ids=GEMM_IDS)
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


@needs_vnni
def test_the_vnni_gemm_agrees_with_the_plain_one_and_keeps_its_shape() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(64, 96), torch.randn(40, 96)
    gemm = VnniGemm(w)
    assert gemm.weight.shape == w.shape and gemm.weight.dtype == torch.bfloat16
    assert gemm.weight.is_contiguous()  # an ordinary tensor: what a shared image can hold
    assert _rel(gemm(x), PlainGemm(w)(x).float()) < 1e-2
    again = VnniGemm.from_packed(gemm.weight.clone())  # as bound from an image
    assert torch.equal(again(x), gemm(x))


@pytest.mark.parametrize("make", GEMMS, ids=GEMM_IDS)
def test_a_row_gets_the_same_bits_whatever_rows_and_threads_beside_it(make: type) -> None:
    """A prompt's KV must not depend on how it was batched or split (prefill runs these
    GEMMs by phase), nor on a worker's thread count (a prefix one worker computed is a hit
    for another, through tier 2)."""
    torch.manual_seed(1)
    gemm = make(torch.randn(64, 128))
    x = torch.randn(300, 128).to(torch.bfloat16)
    whole = gemm(x)
    for lo, hi in ((0, 1), (7, 8), (3, 40), (5, 261), (0, 300)):
        assert torch.equal(gemm(x[lo:hi]), whole[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm(x), whole)
    finally:
        torch.set_num_threads(threads)


def test_bf16_gemm_takes_the_fastest_route_this_cpu_runs() -> None:
    w = torch.randn(64, 96)
    shareable = VnniGemm if vnni_supported() else PlainGemm
    assert isinstance(bf16_gemm(w, shareable=True), shareable)
    fastest = (
        shareable if vnni_supported() else PrepackedGemm if prepacked_supported() else PlainGemm
    )
    assert isinstance(bf16_gemm(w), fastest)
    # A shape the library's kernel does not tile falls back to torch's GEMM.
    odd = torch.randn(20, 24)
    assert isinstance(bf16_gemm(odd, shareable=True), PlainGemm)
    assert torch.allclose(bf16_gemm(odd)(torch.ones(2, 24)), PlainGemm(odd)(torch.ones(2, 24)))


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
