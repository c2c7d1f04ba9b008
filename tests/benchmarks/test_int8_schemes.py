"""``benchmarks.engine.int8_schemes``: its roundings, the weights it reads back from a layer's
GEMM, and the kernel library's W8A8 GEMM against the arithmetic it stands for."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine.int8_schemes import (
    EmulatedGemm,
    W8A8Gemm,
    available,
    bf16_weight,
    build,
    calibrate,
    layer_kernels,
    per_row_int8,
)
from bundled_models.tiny import tiny_model_dir


def test_per_row_int8_rounds_each_row_to_its_own_steps() -> None:
    t = torch.tensor([[0.5, -1.27, 0.004], [100.0, 3.0, -50.0]])
    got = per_row_int8(t)
    for row, out in zip(t, got, strict=True):
        step = float(row.abs().max()) / 127
        assert torch.allclose(out.abs().max(), row.abs().max())  # the extreme is exact
        assert float((out - row).abs().max()) <= step / 2 + 1e-6
        assert torch.allclose(out / step, torch.round(out / step), atol=1e-4)  # on the grid


def test_layers_read_back_and_emulated_as_their_gemm_computes() -> None:
    runner = build(tiny_model_dir(), "bf16", 64, quantization="int4")
    kernels = layer_kernels(runner)
    assert kernels, "the tiny model's int4 layers each hold a GEMM for many rows"
    for kernel in kernels[:4]:  # one layer's qkv, o, gate_up and down
        assert kernel.many_rows is not None
        x = torch.randn(5, kernel.in_features)
        w = bf16_weight(kernel)
        assert w.shape == (kernel.out_features, kernel.in_features)
        want = kernel.many_rows.gemm.forward(x, torch.float32)
        got = EmulatedGemm(w, "a8-token").forward(x, torch.float32)  # int8 rows of x
        exact = x.to(torch.bfloat16).float() @ w.T
        assert torch.allclose(want, exact, rtol=1e-2, atol=1e-2)  # w is that GEMM's weight
        assert not torch.equal(got, exact)
        assert torch.allclose(got, exact, rtol=0.1, atol=0.05)


@pytest.mark.skipif(not available("w8a8"), reason="the kernel library's AVX-512 build is absent")
def test_w8a8_gemm_is_int8_rows_times_int8_channels() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) * 0.05
    x = torch.randn(7, 128, generator=gen)
    got = W8A8Gemm(w).forward(x, torch.float32)
    want = per_row_int8(x.to(torch.bfloat16).float()) @ per_row_int8(w).T
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.01, rel  # the library rounds its output to bfloat16


def test_calibration_keeps_each_layers_input_maxima_and_smoothing_keeps_the_product() -> None:
    runner = build(tiny_model_dir(), "bf16", 64, quantization="int4")
    kernels = layer_kernels(runner)
    before = [k.many_rows.gemm for k in kernels if k.many_rows is not None]
    maxima = calibrate(runner, list(range(3, 90)), 32)
    assert [k.many_rows.gemm for k in kernels if k.many_rows is not None] == before  # put back
    assert len(maxima) == len(kernels)
    for kernel, x_max in zip(kernels, maxima, strict=True):
        assert x_max.shape == (kernel.in_features,)
        assert bool((x_max > 0).all())
    kernel, x_max = kernels[0], maxima[0]
    w = bf16_weight(kernel)
    x = torch.randn(6, kernel.in_features) * x_max  # inputs as large as the text's
    exact = x.to(torch.bfloat16).float() @ w.T
    smooth = EmulatedGemm(w, "w8a8-smooth", x_max).forward(x, torch.float32)
    assert not torch.equal(smooth, exact)
    assert float((smooth - exact).norm() / exact.norm()) < 0.05
