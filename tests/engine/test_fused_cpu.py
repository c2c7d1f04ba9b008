"""The fused CPU backend (engine/model/fused_cpu.py) equals the torch backend, its reference.

Tolerances: float32 ops within 1e-5 (the kernels sum in another order); bfloat16 ops within
one bfloat16 rounding (rtol 2 ** -7: the kernels round once where torch rounds per op);
whole forwards on float32 tiny checkpoints within 1e-4 in logits, the bound the parity
tests against transformers hold too, and the same greedy tokens; in bfloat16, no further
from float32 than the torch backend is (within 50 %).
Skipped where the kernel library does not load (no AVX2, another torch, not installed):
the torch backend then serves, and every other test runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.model import cpu_kernels
from engine.model.backend import TORCH, TorchBackend
from engine.model.fused_cpu import FusedCpuBackend, cpu_backend
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.runner import ModelRunner
from wire.params import SamplingParams

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-7)}  # (atol, rtol)


@pytest.fixture(scope="module")
def fused() -> FusedCpuBackend:
    kernels = cpu_kernels.available()
    if kernels is None:
        pytest.skip("the fused CPU kernel library does not load here")
    rotary = RotaryEmbedding(64, 512, 10000.0, None, torch.device("cpu"), torch.float32)
    return FusedCpuBackend(kernels, rotary)


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5, dtype, torch.device("cpu"))
    norm.weight.data.copy_(torch.rand(dim) + 0.5)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_add_rmsnorm_equals_torch(fused: FusedCpuBackend, dtype: torch.dtype, rows: int) -> None:
    atol, rtol = TOL[dtype]
    norm = _norm(576, dtype)
    x, residual = torch.randn(rows, 576).to(dtype), (3 * torch.randn(rows, 576)).to(dtype)
    torch.testing.assert_close(fused.rmsnorm(x, norm), TORCH.rmsnorm(x, norm), atol=atol, rtol=rtol)
    res_ref, res_fused = residual.clone(), residual.clone()
    want = TORCH.rmsnorm(x, norm, residual=res_ref)
    got = fused.rmsnorm(x.clone(), norm, residual=res_fused)
    torch.testing.assert_close(res_fused, res_ref, atol=0, rtol=0)  # one rounding of a sum
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_rotary_in_place_on_strided_rows_equals_torch(fused: FusedCpuBackend) -> None:
    """The kernel rotates q and k where they lie in the projection (rows of width W)."""
    t, h, kvh, d = 5, 9, 3, 64
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    pos = torch.tensor([0, 3, 17, 300, 511])
    cos = fused.cos_sin[:, : d // 2].repeat(1, 2)[pos].unsqueeze(1)  # (T, 1, D)
    sin = fused.cos_sin[:, d // 2 :].repeat(1, 2)[pos].unsqueeze(1)
    want_q = apply_rotary(qkv[:, : h * d].view(t, h, d), cos, sin)
    want_k = apply_rotary(qkv[:, h * d : (h + kvh) * d].view(t, kvh, d), cos, sin)
    v_before = qkv[:, (h + kvh) * d :].clone()
    q, k = qkv[:, : h * d], qkv[:, h * d : (h + kvh) * d]
    torch.ops._C.rotary_embedding(pos, q, k, d, fused.cos_sin, True)
    torch.testing.assert_close(q.reshape(t, h, d), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.reshape(t, kvh, d), want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (h + kvh) * d :], v_before)


def _run(path: Path, backend: str, dtype: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Chunked prefill of 3 prompts, then 5 batched decode steps of teacher-forced tokens:
    every step's logits, and the pool after."""
    runner = ModelRunner(
        EngineConfig(model=str(path), num_kv_blocks=64, attention_backend=backend, dtype=dtype)
    )
    expect = TorchBackend if backend == "torch" else FusedCpuBackend
    assert type(runner.backend) is expect
    g = torch.Generator().manual_seed(0)
    seqs = [
        Sequence(i, torch.randint(0, 1000, (n,), generator=g).tolist(), sampling=SamplingParams())
        for i, n in enumerate((7, 33, 20))
    ]
    logits = [runner.prefill([(s, min(16, s.num_tokens)) for s in seqs])]
    logits.append(runner.prefill([(s, s.num_uncomputed_tokens) for s in seqs[1:]]))
    for step in range(5):
        for s in seqs:
            s.output_ids.append(100 + step + s.rid)
        logits.append(runner.decode(seqs))
    return logits, runner.kv.tensor


def test_forward_equals_torch_backend(fused: FusedCpuBackend, tiny_model_path: Path) -> None:
    """float32: prefill (fresh and continued chunks), decode over the kept dense K/V, and
    the pool's contents, on every tiny architecture (Qwen3's per-head norms take the other
    branch of ``attend``)."""
    want, want_pool = _run(tiny_model_path, "torch", "float32")
    got, got_pool = _run(tiny_model_path, "auto", "float32")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # K/V are rounded once to the cache's dtype: equal up to a rounding either side of a tie.
    torch.testing.assert_close(got_pool.float(), want_pool.float(), atol=0.02, rtol=2**-7)


def test_bfloat16_forward_as_close_to_float32_as_torch(
    fused: FusedCpuBackend, tiny_model_path: Path
) -> None:
    """In bfloat16 the backends round differently (~2 % of the logits' range apart after a
    few layers), so each is set against the float32 forward: the fused one is no further
    from it than the torch one, within 50 % (seen: up to 20 %)."""
    ref, _ = _run(tiny_model_path, "torch", "float32")
    by_torch, _ = _run(tiny_model_path, "torch", "bfloat16")
    by_fused, _ = _run(tiny_model_path, "auto", "bfloat16")
    for r, t, f in zip(ref, by_torch, by_fused):
        err_torch, err_fused = (t - r).abs().max(), (f - r).abs().max()
        assert err_fused <= 1.5 * err_torch, (float(err_fused), float(err_torch))


def test_torch_backend_forced_or_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    rotary = RotaryEmbedding(64, 16, 10000.0, None, torch.device("cpu"), torch.float32)
    assert cpu_backend("torch", rotary) is TORCH
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "off")
    with pytest.raises(cpu_kernels.CpuKernelsUnavailable, match="PDSERVE_CPU_KERNELS"):
        cpu_kernels.load()
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "/nonexistent")
    if cpu_kernels.cpu_isa() is not None:
        with pytest.raises(cpu_kernels.CpuKernelsUnavailable, match="not found"):
            cpu_kernels.load()


def test_build_chosen_from_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2-only CPUs get the AVX2 build; AVX-512 without BF16 its own; none below AVX2."""
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    for avx512, bf16, capability, want in [
        (True, True, "AVX512", "avx512_bf16"),
        (True, False, "AVX512", "avx512"),
        (False, False, "AVX2", "avx2"),
        (False, False, "DEFAULT", None),
    ]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda v=avx512: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=bf16: v)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda v=capability: v)
        assert cpu_kernels.cpu_isa() == want
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert cpu_kernels.cpu_isa() is None
