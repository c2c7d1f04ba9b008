"""pdserve's int4 kernel (``engine/weights/int4_tiles.py``): each kernel this CPU runs
equals the float32 product of bfloat16 inputs and the de-quantized weights, and gives a row
the same bits whatever the rows beside it and the threads, which is what lets a speculative
verification reproduce a decode step."""

from __future__ import annotations

import pytest
import torch

from engine.weights import int4_tiles
from engine.weights.linear import (
    Int4Kernel,
    Int8Kernel,
    nibble_planes,
    prefill_phase,
    tiles_gemm,
)
from engine.weights.quant import Int4Rows, Int8Rows, quantize_int4, quantize_int8

CPU = torch.device("cpu")


def _rows(n: int, k: int, seed: int) -> Int4Rows:
    gen = torch.Generator().manual_seed(seed)
    return quantize_int4(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen))


@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 96), (960, 576), (50, 1536)])
def test_each_kernel_equals_the_float32_product_of_its_rounded_inputs(
    int4_kernel: str, n: int, k: int
) -> None:
    """40 and 50 outputs: a partly padded tile; 1536 inputs: SmolLM2's down projection."""
    rows = _rows(n, k, n + k)
    kernel = Int4Kernel(rows, torch.bfloat16, CPU)
    assert kernel.kernel == int4_kernel
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(1))
    want = x.bfloat16().float() @ rows.dequantize().T
    got = kernel(x, None)
    assert got.shape == (21, n) and got.dtype == torch.float32
    # float32 sums (pdserve's kernels) or a bfloat16 product (torch's)
    if int4_kernel == "avx512_vnni":  # int8 inputs: the product of the quantized rows
        want = _int8_input_product(x, rows).float()
    tol = 2e-2 if int4_kernel == "torch" else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_float32_rows_are_rounded_as_torch_rounds_them(int4_kernel: str) -> None:
    """The kernels take float32 input and round it to bfloat16 themselves: the same bits
    as a bfloat16 input, from strided rows too (a view of a wider tensor)."""
    if int4_kernel == "torch":
        pytest.skip("torch's kernel is fed its scales' dtype by Int4Kernel")
    rows = _rows(48, 96, 3)
    tiles = int4_tiles.pack(rows)
    wide = torch.randn(7, 160, generator=torch.Generator().manual_seed(2))
    x = wide[:, 32:128]  # (7, 96), row stride 160
    want = int4_tiles.mm(x.bfloat16(), tiles, 48, int4_kernel)
    assert torch.equal(int4_tiles.mm(x, tiles, 48, int4_kernel), want)
    assert torch.equal(int4_tiles.mm(x.contiguous(), tiles, 48, int4_kernel), want)
    assert torch.equal(int4_tiles.mm(wide.bfloat16()[:, 32:128], tiles, 48, int4_kernel), want)
    # Other dtypes are widened to float32 first; float16 holds these exactly enough
    # that the bfloat16 rounding agrees.
    half = x.half()
    assert torch.equal(
        int4_tiles.mm(half, tiles, 48, int4_kernel),
        int4_tiles.mm(half.float().bfloat16(), tiles, 48, int4_kernel),
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_in_any_batch_and_on_any_threads(
    int4_kernel: str, bits: int
) -> None:
    """Batches of 1 to 40 rows cross the kernels' blocks of 8 and 16 rows."""
    if int4_kernel == "torch":
        pytest.skip("torch's int4 kernel gives no such promise")
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(72, 192, generator=gen)
    kernel = Int4Kernel(quantize_int4(w), torch.bfloat16, CPU)
    if bits == 8:
        kernel = Int8Kernel(quantize_int8(w), torch.bfloat16, CPU)
    x = torch.randn(40, 192, generator=gen)
    alone = torch.cat([kernel(x[i : i + 1], None) for i in range(40)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 5, 8, 9, 16, 17, 40):
                assert torch.equal(kernel(x[:m], None), alone[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)


def test_the_layout_holds_the_grid_exactly() -> None:
    """Reading the packed bytes back gives the codes, and float16 scale and offset."""
    rows = _rows(24, 64, 0)
    tiles = int4_tiles.pack(rows)
    assert tiles.shape == (2, 2, 320) and tiles.dtype == torch.uint8
    codes = tiles[..., :256].reshape(2, 2, 8, 16, 2)  # (T, G, chunk q, output, input j)
    lo, hi = codes & 15, codes >> 4  # inputs 2q + j and 16 + 2q + j
    c = torch.cat((lo, hi), dim=2).permute(0, 3, 1, 2, 4).reshape(32, 64)  # (N padded, K)
    assert torch.equal(c[:24], rows.codes) and not c[24:].any()
    scale = tiles[..., 256:288].contiguous().view(torch.float16).float()  # (T, G, 16)
    offset = tiles[..., 288:].contiguous().view(torch.float16).float()
    assert torch.equal(scale.permute(0, 2, 1).reshape(32, 2)[:24], rows.scale)
    want = rows.zero - 8 * rows.scale
    assert torch.equal(offset.permute(0, 2, 1).reshape(32, 2)[:24], want)


def test_a_kernel_that_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "int3")
    with pytest.raises(int4_tiles.Int4KernelUnavailable, match="expected one of"):
        int4_tiles.kernel_name()
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "torch")
    assert int4_tiles.kernel_name() == "torch"
    assert "torch" in int4_tiles.available_kernels()
    for name in ("amx", "avx512_vnni", "avx512_bf16"):
        if name not in int4_tiles.available_kernels():
            monkeypatch.setenv("PDSERVE_INT4_KERNEL", name)
            with pytest.raises(int4_tiles.Int4KernelUnavailable, match=name):
                int4_tiles.kernel_name()
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_tiles.pack(Int4Rows(torch.zeros(16, 40, dtype=torch.uint8), *torch.zeros(2, 16, 1)))


def test_packed_weights_bind_only_to_the_kernel_that_packed_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "torch")
    kernel = Int4Kernel(_rows(16, 32, 3), torch.bfloat16, CPU)
    again = Int4Kernel.from_packed("torch", kernel.shape, **kernel.layout())
    x = torch.randn(3, 32)
    assert torch.equal(again(x, None), kernel(x, None))
    others = [k for k in int4_tiles.available_kernels() if k != "torch"]
    if others:
        monkeypatch.setenv("PDSERVE_INT4_KERNEL", others[0])
        with pytest.raises(ValueError, match="packed for the torch int4 kernel"):
            Int4Kernel.from_packed("torch", kernel.shape, **kernel.layout())


def _packed_layer(
    bits: int, gen: torch.Generator
) -> tuple[Int4Rows | Int8Rows, Int4Kernel | Int8Kernel]:
    """A (50, 96) layer quantized to ``bits`` and packed for the process's int4 kernel."""
    w = torch.randn(50, 96, generator=gen)
    rows = quantize_int4(w) if bits == 4 else quantize_int8(w)
    return rows, (Int4Kernel if bits == 4 else Int8Kernel)(rows, torch.bfloat16, CPU)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_tiles_gemm_is_a_bfloat16_gemm_of_the_same_tiles(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TilesGemm`` (AMX, many rows): the float32 product of bfloat16 inputs and the
    de-quantized weights rounded to bfloat16, what a bfloat16 copy of the weights gives
    (an int8 layer's two nibble planes are rounded apart: within bfloat16's error of it);
    rows 1 to 40 (blocks of 16 and a remainder), 50 outputs (a padded tile), a row's bits
    whatever the rows beside it."""
    if "amx" not in int4_tiles.available_kernels():
        pytest.skip("the AMX int4 kernel does not run here")
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "amx")
    gen = torch.Generator().manual_seed(bits)
    rows, kernel = _packed_layer(bits, gen)
    gemm = tiles_gemm(kernel)
    x = torch.randn(40, 96, generator=gen)
    want = x.bfloat16().float() @ rows.dequantize().bfloat16().float().T
    got = gemm(x, torch.float32)
    if bits == 4:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        assert ((got - want).norm() / want.norm()).item() < 4e-3
    for m in (1, 16, 17):
        assert torch.equal(gemm(x[:m], torch.float32), got[:m])


def _int8_input_product(x: torch.Tensor, rows: Int4Rows) -> torch.Tensor:
    """float64 reference of ``A8Gemm``'s sums: x rounded to bfloat16, each group of 32
    quantized to int8 as the kernel does in float32 (d = max |x| / 127, q = x * (1 / d)
    rounded half to even), the exact code products scaled per group, and the offset term
    on the quantized group sums (d * sum q): the product of the quantized x."""
    m, k = x.shape
    xg = x.bfloat16().float().view(m, k // 32, 32)
    d = xg.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, 0.0)
    q = torch.round(xg * inv.unsqueeze(-1)).double()
    xg, d = xg.double(), d.double()
    codes = rows.codes.double().view(rows.codes.shape[0], k // 32, 32)
    offset = rows.zero.double() - 8 * rows.scale.double()  # W = c scale + offset
    dots = torch.einsum("mgk,ngk->mng", q, codes)
    y = (dots * rows.scale.double().unsqueeze(0) * d.unsqueeze(1)).sum(-1)
    return y + (d * q.sum(-1)) @ offset.T


@pytest.mark.parametrize("bits", [4, 8])
def test_the_int8_input_gemm_is_the_exact_sum_of_its_quantized_inputs(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``A8Gemm`` (``--gemm-inputs int8``): the products of each group's int8 inputs with
    the codes, scaled once per group, to float32's rounding of the float64 reference; an
    int8 layer's two nibble planes take the input twice; rows 1 to 40 (blocks of 4 and a
    remainder), 50 outputs (a padded tile); a row's bits whatever the rows beside it and
    the threads; within int8's error (about 1 %) of the float32 product."""
    if not int4_tiles.a8_supported() or "avx512_bf16" not in int4_tiles.available_kernels():
        pytest.skip("the int8-input GEMM does not run here")
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "avx512_bf16")
    gen = torch.Generator().manual_seed(bits)
    rows, kernel = _packed_layer(bits, gen)
    gemm = tiles_gemm(kernel, "int8")
    assert isinstance(gemm, int4_tiles.A8Gemm)
    x = torch.randn(40, 96, generator=gen) * torch.rand(40, 1, generator=gen)
    x[3, :32] = 0.0  # a group of zeros: d = 0
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "avx512_vnni")
    vnni = _packed_layer(bits, torch.Generator().manual_seed(bits))[1]
    assert vnni.kernel == "avx512_vnni"
    got = gemm(x, torch.float32)
    planes = nibble_planes(rows) if isinstance(rows, Int8Rows) else rows
    want = _int8_input_product(x if bits == 4 else torch.cat((x, x), 1), planes)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ rows.dequantize().double().T
    assert ((got.double() - exact).norm() / exact.norm()).item() < 2e-2
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 3, 4, 5, 8, 9, 17):  # up to 8 rows: the tiles read straight
                assert torch.equal(gemm(x[:m], torch.float32), got[:m]), (threads, m)
                # The avx512_vnni kernel runs the same op at any rows, fed float32.
                assert torch.equal(vnni(x[:m], None, torch.float32), got[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)


def test_int8_inputs_are_refused_where_they_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert int4_tiles.gemm_inputs("bfloat16") == "bfloat16"
    with pytest.raises(int4_tiles.Int4KernelUnavailable, match="expected one of"):
        int4_tiles.gemm_inputs("int4")
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "torch")
    with pytest.raises(int4_tiles.Int4KernelUnavailable, match="torch int4 kernel"):
        int4_tiles.gemm_inputs("int8")


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_input_layers_take_bfloat16_pair_dots_in_a_prefill_forward(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``avx512_vnni``: outside a prefill forward, int8 inputs at any rows; inside one
    (no GEMM held), the ``avx512_bf16`` kernel on the same tiles; after ``per_row``
    (batch-invariant serving), int8 inputs in both."""
    available = int4_tiles.available_kernels()
    if "avx512_vnni" not in available or "avx512_bf16" not in available:
        pytest.skip("the avx512_vnni int4 kernel does not run here")
    gen = torch.Generator().manual_seed(bits)
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "avx512_bf16")
    _, pairs = _packed_layer(bits, gen)
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "avx512_vnni")
    _, vnni = _packed_layer(bits, torch.Generator().manual_seed(bits))
    x = torch.randn(6, 96, generator=gen)
    a8 = vnni(x, None)
    assert not torch.equal(a8, pairs(x, None))
    with prefill_phase():
        assert torch.equal(vnni(x, None), pairs(x, None))
    vnni.per_row()
    with prefill_phase():
        assert torch.equal(vnni(x, None), a8)
