"""Packed weights: GGUF blocks reproduce their de-quantization exactly, quantizing at load
stays within its grid, and a quantized checkpoint serves through the engine.

Exactness is checked in float32 (each kernel built with float32 scales): a packed layer
times the identity must give back, bit for bit, the weights ``gguf`` de-quantizes. Serving
runs the same kernels in bfloat16, an approximation measured by the perplexity benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bundled_models import tiny
from engine.build import build_engine
from engine.checkpoint.gguf import GGUFCheckpoint, convert_gguf, hf_tensors
from engine.config import EngineConfig
from engine.kernels.cpu import ops
from engine.kv.sequence import Sequence
from engine.weights.gemm import PlainGemm
from engine.weights.linear import (
    DenseKernel,
    Embedding,
    Int4Kernel,
    Int8Kernel,
    Linear,
    decode_rows,
    packed_kernel,
    prefill_phase,
)
from engine.weights.plan import QuantizationError, resolve_quantization
from engine.weights.quant import (
    Int4Rows,
    Int8Rows,
    QuantRows,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
)
from engine.weights.refined_head import RefinedHead
from tests.engine.gguf_files import Q, write_gguf
from wire.params import SamplingParams

PACKABLE = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
CPU = torch.device("cpu")


def _times_identity(kernel: torch.nn.Module, k: int) -> torch.Tensor:
    """The (N, K) weight a kernel multiplies by, read back through the kernel itself: in
    a prefill forward, so ``avx512_vnni`` reads its tiles with bfloat16 pair-dots (its
    prompt kernel), since an identity row's int8 scale (1 / 127) is not exact."""
    with prefill_phase():
        return kernel(torch.eye(k), None).T


@pytest.mark.usefixtures("int4_kernel")
@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_blocks_of_random_weights_pack_exactly(qtype: Q) -> None:
    """40 rows (not a multiple of the kernel's 16: padded), 96 inputs, wide scales."""
    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((40, 96)).astype(np.float32) * rng.uniform(1e-3, 5.0, (40, 1))
    data = gguf.quants.quantize(w.astype(np.float32), qtype)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    rows = from_gguf_blocks(data, qtype, (40, 96))
    assert torch.equal(rows.dequantize(), want)
    kernel = packed_kernel(rows, torch.float32, CPU)
    assert torch.equal(_times_identity(kernel, 96), want)


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Q, tuple[Path, Path]]:
    """qtype -> (GGUF file, its converted checkpoint) of the tiny Llama model."""
    out = {}
    for qtype in PACKABLE:
        tmp = tmp_path_factory.mktemp(qtype.name)
        path = write_gguf(tiny.tiny_model_dir("llama"), tmp / "m.gguf", qtype, vocab=False)
        convert_gguf(path, tmp / "hf")
        out[qtype] = (path, tmp / "hf")
    return out


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_a_gguf_file_packs_to_exactly_what_gguf_dequantizes(
    gguf_dirs: dict[Q, tuple[Path, Path]], qtype: Q
) -> None:
    """Every matrix of a Q4_0 / Q4_1 / Q8_0 file written by the tests (llama: Q/K rows
    permuted by llama.cpp's converter, undone on the way in)."""
    path, hf = gguf_dirs[qtype]
    config = json.loads((hf / "config.json").read_text())
    ckpt = GGUFCheckpoint(path)
    dense = {n: t for n, t, _ in hf_tensors(ckpt, config)}  # gguf.quants.dequantize
    packed = list(hf_tensors(ckpt, config, packed=True))
    matrices = [(n, v) for n, v, q in packed if q == qtype.name]
    head = 0 if config.get("tie_word_embeddings") else 1
    assert len(matrices) == 1 + 7 * config["num_hidden_layers"] + head  # embedding, layers
    for name, rows in matrices:
        assert isinstance(rows, Int4Rows | Int8Rows), name
        assert torch.equal(rows.dequantize(), dense[name]), name
        if name == "model.embed_tokens.weight":
            emb = Embedding(*rows.codes.shape, torch.float32, CPU)
            emb.set_quantized(rows)
            ids = torch.tensor([0, 5, 255])
            assert torch.equal(emb(ids), dense[name][ids])
            continue
        kernel = packed_kernel(rows, torch.float32, CPU)
        assert torch.equal(_times_identity(kernel, rows.codes.shape[1]), dense[name]), name


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_a_converted_gguf_is_served_packed_and_near_its_dequantized_self(
    gguf_dirs: dict[Q, tuple[Path, Path]], qtype: Q
) -> None:
    _, hf = gguf_dirs[qtype]
    packed = build_engine(EngineConfig(model=str(hf), num_kv_blocks=16)).runner
    assert packed.quantization == "gguf"
    kind = "int8" if qtype == Q.Q8_0 else "int4"
    layers = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert {m.kind for m in layers} == {kind}  # the head too: this model's is its own
    dense = build_engine(EngineConfig(model=str(hf), num_kv_blocks=16, quantization="none")).runner
    prompts = [[9, 70, 11, 187, 0, 42], list(range(100, 133))]
    got, want = [], []
    for runner, out in ((packed, got), (dense, want)):
        seqs = [Sequence(i, p, sampling=SamplingParams()) for i, p in enumerate(prompts)]
        out.append(runner.prefill([(s, s.num_tokens) for s in seqs]))
        for s in seqs:
            s.output_ids.append(7)
        out.append(runner.decode(seqs))
    for g, w in zip(got, want, strict=True):
        # bfloat16 at each linear layer's boundary: about 1 % of the logits' norm here.
        assert ((g - w).norm() / w.norm()).item() < 3e-2


@pytest.mark.usefixtures("int4_kernel")
def test_the_head_recomputes_its_leading_logits_in_float32() -> None:
    torch.manual_seed(0)
    rows = quantize_int8(torch.randn(256, 64))
    head = RefinedHead(packed_kernel(rows, torch.bfloat16, CPU), rows)
    x = torch.randn(3, 64)
    exact = x @ rows.dequantize().T
    got = head(x, None)
    top = exact.argmax(dim=1)
    assert torch.equal(got.argmax(dim=1), top)
    rows_ = torch.arange(3)
    torch.testing.assert_close(got[rows_, top], exact[rows_, top], rtol=1e-6, atol=1e-5)


def test_the_heads_near_logits_by_threshold_are_those_of_its_top_k() -> None:
    """The threshold path refines each row's near logits, the set the top-k path takes,
    with the same per-logit sums (bit for bit, as batch-invariant serving computes them);
    a row with more than ``_MAX_REFINED`` near logits sends the batch to the top-k path,
    which refines its largest ones only."""
    torch.manual_seed(1)
    rows = quantize_int8(torch.randn(512, 64) * 0.05)
    head = RefinedHead(packed_kernel(rows, torch.bfloat16, CPU), rows)
    head.row_invariant = True
    head.refine_op = None  # the torch path (the op's: the test below)
    x = torch.randn(4, 64) * 20
    packed = head.packed.forward(x, None, torch.float32)
    want = head._refine_top(packed.clone(), x, None)
    got = head(x, None)
    assert torch.equal(got, want)
    refined = (got != packed).sum(dim=1)
    assert (refined >= 1).all() and (refined <= head._MAX_REFINED).all()
    # A flat row: every logit is near its maximum, more than the cap.
    flat = torch.zeros(1, 64)
    flat_packed = head.packed.forward(flat, None, torch.float32)
    assert int((flat_packed >= flat_packed.max() - 1e-3).sum()) > head._MAX_REFINED
    assert torch.equal(head(flat, None), head._refine_top(flat_packed.clone(), flat, None))


def test_the_near_logits_op_refines_what_the_torch_path_does() -> None:
    """``refine_near_logits`` (one op) against RefinedHead's torch ops: the same logits
    refined, to float32 rounding (their sums run in different orders), with a bias; a row's
    bits the same alone as among others; a row with more near logits than the cap gets its
    largest ones refined, ties to the lower index."""
    op = ops.refine_near_logits_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels do not run here")
    torch.manual_seed(2)
    w = torch.randn(700, 96) * 0.05
    w[:100] = w[0]  # 100 equal logits: the largest for x[4] below
    rows = quantize_int8(w)
    head = RefinedHead(packed_kernel(rows, torch.bfloat16, CPU), rows)
    bias = torch.randn(700) * 0.01
    bias[:100] = 0.0
    x = torch.randn(5, 96) * 20
    x[4] = w[0] / w[0].norm() * 20
    packed = head.packed.forward(x, bias, torch.float32)
    got = op(packed.clone(), x, rows.codes, rows.scale, bias, head._MARGIN_STEPS, head._MAX_REFINED)
    head.refine_op = None
    want = head._refine_top(packed.clone(), x, bias)
    assert torch.equal(got[:4] != packed[:4], want[:4] != packed[:4])
    torch.testing.assert_close(got[:4], want[:4], rtol=1e-6, atol=1e-6)
    changed = (got[4] != packed[4]).nonzero().flatten()
    assert torch.equal(changed, torch.arange(head._MAX_REFINED))
    torch.testing.assert_close(got[4, :64], want[4].max().expand(64), rtol=1e-6, atol=1e-6)
    for r in range(5):
        alone = op(packed[r : r + 1].clone(), x[r : r + 1], rows.codes, rows.scale, bias, 4, 64)
        assert torch.equal(alone[0], got[r])
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        op(packed.clone(), x[:, :64].contiguous(), rows.codes, rows.scale, None, 4, 64)


@pytest.mark.usefixtures("int4_kernel")
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_at_load_stays_on_its_grid(bits: int) -> None:
    torch.manual_seed(bits)
    w = torch.randn(48, 128) * torch.rand(48, 1) * 3
    rows = quantize_int4(w) if bits == 4 else quantize_int8(w)
    err = (rows.dequantize() - w).abs().unflatten(1, (-1, 32))
    assert (err <= rows.scale[..., None] / 2 + 1e-6).all()  # round to nearest code
    kernel = packed_kernel(rows, torch.float32, CPU)
    # float16 scales and offsets, as GGUF's: every kernel holds them exactly, and may
    # round its products otherwise than (c - 8) * s + z does.
    torch.testing.assert_close(_times_identity(kernel, 128), rows.dequantize(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_at_load_on_every_tiny_architecture(
    tiny_model_path: Path, quantization: str
) -> None:
    runner = build_engine(
        EngineConfig(model=str(tiny_model_path), num_kv_blocks=16, quantization=quantization)
    ).runner
    dense = build_engine(
        EngineConfig(model=str(tiny_model_path), num_kv_blocks=16, quantization="none")
    ).runner
    body = {m.kind for m in runner.model.modules() if isinstance(m, Linear)}
    assert body == ({"int8"} if quantization == "int8" else {"int4", "int8"})
    assert runner.model.lm_head.kind == "int8"
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    outs = []
    for r in (runner, dense):
        s = Sequence(0, prompt, sampling=SamplingParams())
        outs.append(r.prefill([(s, s.num_tokens)]))
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    # Random tiny weights are the worst case for a 16-level grid (measured: int8 ~2 %,
    # int4 up to ~35 %); the real model's loss is measured by benchmarks.engine.perplexity.
    assert rel < (5e-2 if quantization == "int8" else 0.5)


def test_packed_kernels_are_refused_off_cpu(tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match="CPU only"):
        resolve_quantization("int4", tiny.tiny_model_dir("llama"), "cuda")
    with pytest.raises(QuantizationError, match="one of"):
        resolve_quantization("int3", tiny.tiny_model_dir("llama"), "cpu")
    assert resolve_quantization("auto", tiny.tiny_model_dir("llama"), "cpu") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        Int4Kernel(quantize_int4(torch.randn(16, 32)), torch.bfloat16, torch.device("meta"))


@pytest.mark.usefixtures("int4_kernel")
@pytest.mark.parametrize("bits", [4, 8])
def test_calls_of_many_rows_take_the_gemm_and_few_stay_packed(bits: int) -> None:
    torch.manual_seed(bits)
    rows = quantize_int4(torch.randn(48, 64)) if bits == 4 else quantize_int8(torch.randn(48, 64))
    packed = packed_kernel(rows, torch.bfloat16, CPU)
    both = packed_kernel(rows, torch.bfloat16, CPU)
    gemm = PlainGemm(rows.dequantize())
    both.with_gemm(gemm, min_rows=8)
    few, many = torch.randn(7, 64), torch.randn(8, 64)
    assert torch.equal(both(few, None), packed(few, None))  # below the crossover: packed
    got = both(many, None)
    assert torch.equal(got, gemm(many))  # from it on: the GEMM
    assert not torch.equal(got, packed(many, None))  # another kernel indeed
    exact = many @ rows.dequantize().T
    assert ((got - exact).norm() / exact.norm()).item() < 1e-2  # bfloat16 weights
    with prefill_phase():  # a prefill forward: the GEMM whatever the rows
        assert torch.equal(both(few, None), gemm(few))
    with decode_rows(1):  # several rows of one sequence (verification): as its decode step
        assert torch.equal(both(many, None), packed(many, None))
    head = packed_kernel(rows, torch.bfloat16, CPU)  # the LM head: by rows, even in prefill
    head.with_gemm(gemm, min_rows=8, by_phase=False)
    with prefill_phase():
        assert torch.equal(head(few, None), packed(few, None))
        assert torch.equal(head(many, None), gemm(many))


def _packed_linear(bits: int) -> tuple[Linear, Int4Kernel | Int8Kernel, QuantRows]:
    """A float32 (64 -> 48) linear on a packed kernel of random ``bits``-bit weights, its
    plain GEMM from 16 rows on; the layer, its kernel and its rows."""
    torch.manual_seed(bits)
    q = quantize_int4(torch.randn(48, 64)) if bits == 4 else quantize_int8(torch.randn(48, 64))
    kernel = packed_kernel(q, torch.bfloat16, CPU)
    kernel.with_gemm(PlainGemm(q.dequantize()), min_rows=16)
    linear = Linear(64, 48, False, torch.float32, CPU)
    linear.kernel = kernel
    return linear, kernel, q


@pytest.mark.usefixtures("int4_kernel")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [3, 40], ids=["packed", "gemm"])
def test_native_is_forward_without_its_cast_back(bits: int, rows: int) -> None:
    """``Linear.native``: the dtype the call's path computes in (the packed kernel's:
    bfloat16 for torch's int4 kernel, float32 for pdserve's; the GEMM's for many rows),
    which ``forward`` widens to x's dtype; a bfloat16 input gives what its float32
    widening gives, in the dtype asked for; with a bias, ``native`` is ``forward``."""
    linear, kernel, _ = _packed_linear(bits)
    x = torch.randn(rows, 64)
    native = linear.native(x)
    want = kernel.compute_dtype if rows < 16 else PlainGemm.compute_dtype
    assert native.dtype == want and torch.equal(native.float(), linear(x))
    xb = x.bfloat16()
    assert torch.equal(linear(xb, torch.float32), linear(xb.float()))
    biased = Linear(64, 48, True, torch.float32, CPU)
    biased.kernel = kernel
    assert biased.bias is not None
    biased.bias.data.normal_()
    assert biased.native(x).dtype == torch.float32 and torch.equal(biased.native(x), biased(x))


@pytest.mark.usefixtures("int4_kernel")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [3, 40], ids=["packed", "gemm"])
def test_input_dtype_for_is_what_the_call_rounds_its_input_to(bits: int, rows: int) -> None:
    """``Linear.input_dtype_for``: a producer may hand x over already rounded to it (the
    fused SiLU * up does, for down) and the product has the same bits; a dense float32
    layer reads x as it is."""
    linear, _, q = _packed_linear(bits)
    x = torch.randn(rows, 64)
    dtype = linear.input_dtype_for(x)
    assert dtype == torch.bfloat16  # every packed path and GEMM here reads bfloat16
    assert torch.equal(linear(x.to(dtype), torch.float32), linear(x))
    dense = Linear(64, 48, False, torch.float32, CPU)
    dense.kernel = DenseKernel(q.dequantize())
    assert dense.input_dtype_for(x) == torch.float32


@pytest.mark.parametrize(
    "qtype, want", [(Q.Q4_1, "gguf"), (Q.Q8_0, "gguf"), (Q.F32, "none"), (Q.F16, "none")]
)
def test_auto_serves_a_gguf_packed_only_where_it_holds_packable_blocks(
    qtype: object, want: str, tmp_path: Path
) -> None:
    """``auto`` reads the source file's header (the launcher and every worker ask before
    they load anything): Q4_0/Q4_1/Q8_0 blocks are served packed, anything else as the
    de-quantized copy. The files carry the tiny checkpoint's whole 152k-token vocabulary,
    the string array the header reader walks past."""
    path = write_gguf(tiny.tiny_model_dir("llama"), tmp_path / "m.gguf", qtype)
    convert_gguf(path, tmp_path / "hf")
    assert resolve_quantization("auto", tmp_path / "hf", "cpu") == want
