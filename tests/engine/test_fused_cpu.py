"""The fused CPU backend (engine/model/fused_cpu.py) equals the torch backend, its reference.

Tolerances: float32 ops within 1e-5 (the kernels sum in another order); bfloat16 ops within
one bfloat16 rounding (rtol 2 ** -7: the kernels round once where torch rounds per op);
whole float32 forwards of SmolLM2 within 1e-4 in logits, the bound the parity tests
against transformers hold too, and the same greedy tokens; in bfloat16, no further from
float32 than the torch backend is (within 50 %).
Skipped where the kernel library does not load (no AVX2, another torch, not installed):
the torch backend then serves, and every other test runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bundled_models.default_model import resolve_model
from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kernels import vllm_cpu
from engine.kernels.cpu.ops import (
    decode_attention_op,
    prefill_attention_op,
    rope_store_op,
    silu_mul_op,
)
from engine.kv.sequence import Sequence
from engine.model.attention import AttentionMetadata
from engine.model.fused_cpu import FusedCpuBackend, PagedBatch, cpu_backend
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary
from engine.model.torch_backend import TorchBackend, TorchGeometry
from engine.runner import ModelRunner
from wire.params import SamplingParams

CPU = torch.device("cpu")


def _geometry(positions: int, block_size: int = 16) -> TorchGeometry:
    rotary = RotaryEmbedding(64, positions, 10000.0, None, CPU, torch.float32)
    return TorchGeometry(1, 4, block_size, torch.bfloat16, rotary, CPU)


TORCH = TorchBackend(_geometry(16))  # the reference of the row-wise ops
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-7)}  # (atol, rtol)


@pytest.fixture(scope="module")
def fused() -> FusedCpuBackend:
    kernels = vllm_cpu.available()
    if kernels is None:
        pytest.skip("the fused CPU kernel library does not load here")
    return FusedCpuBackend(kernels, _geometry(512))


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M (head size 64): the tiny checkpoints' heads of 16 the library's
    attention does not take, so they run the torch backend."""
    return resolve_model(None)


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


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_torch(
    fused: FusedCpuBackend, in_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """pdserve's one-pass SiLU * up, where built: within 6e-7 relative of torch's in float32 (one
    rounding in bfloat16), on gates far into both tails, 1536 (SmolLM2's) and 40 columns
    (a partial vector), and a row's bits alone as in a batch of 33."""
    if silu_mul_op() is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    gen = torch.Generator().manual_seed(0)
    for inter in (1536, 40):
        gate_up = (torch.randn(33, 2 * inter, generator=gen) * 8).to(in_dtype)
        gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0]).to(in_dtype)
        got = fused.silu_mul(gate_up, dtype)
        assert got.dtype == dtype and got.shape == (33, inter)
        atol, rtol = TOL[dtype] if dtype == torch.bfloat16 else (1e-30, 6e-7)
        want = TORCH.silu_mul(gate_up.float(), torch.float32).to(dtype)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        alone = torch.cat([fused.silu_mul(gate_up[i : i + 1], dtype) for i in range(33)])
        assert torch.equal(alone, got)
    strided = torch.randn(5, 200, generator=gen)[:, 20:180]  # (5, 160): a view, row stride 200
    torch.testing.assert_close(
        fused.silu_mul(strided, torch.float32),
        TORCH.silu_mul(strided, torch.float32),
        atol=1e-30,
        rtol=3e-7,
    )


def test_silu_mul_rounds_once_to_the_down_projections_dtype(fused: FusedCpuBackend) -> None:
    """Computed in float32 and handed down in bfloat16 (the dtype down rounds its input
    to): the bits of the float32 result cast, one pass fewer."""
    if silu_mul_op() is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    gen = torch.Generator().manual_seed(2)
    for in_dtype in (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(17, 2 * 1536, generator=gen) * 4).to(in_dtype)
        want = fused.silu_mul(gate_up, torch.float32).to(torch.bfloat16)
        assert torch.equal(fused.silu_mul(gate_up, torch.float32, torch.bfloat16), want)
        wide = TORCH.silu_mul(gate_up, torch.float32, torch.bfloat16)
        assert wide.dtype == torch.bfloat16
        torch.testing.assert_close(wide.float(), want.float(), atol=2**-7, rtol=2**-7)


def _pool_views(
    pool: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:  # as FusedCpuBackend._layer_caches lays them out
    nb, layers, _, bs, kvh, d = pool.shape
    chunk = bs * kvh * d
    shape, strides = (nb, kvh, bs, d), (layers * 2 * chunk, bs * d, d, 1)
    return (
        pool.as_strided(shape, strides, 2 * layer * chunk),
        pool.as_strided(shape, strides, (2 * layer + 1) * chunk),
    )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_gives_the_library_paths_bits(
    fused: FusedCpuBackend, in_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """pdserve's one-pass rotary + K/V store: q and every pool byte equal to widening qkv,
    the library's ``rotary_embedding``, rounding to the cache's dtype and its
    ``cpu_attn_reshape_and_cache``, on a strided projection, scattered slots across blocks
    and layers, and a negative slot (not stored)."""
    rope_store = rope_store_op()
    if rope_store is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    h, kvh, d, bs, t = 9, 3, 64, 16, 41
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(t, (h + 2 * kvh) * d + 8, generator=gen).to(in_dtype)
    qkv = wide[:, 8:]  # row stride (H + 2 KVH) D + 8
    pos = torch.randint(0, 512, (t,), generator=gen)
    slots = torch.randperm(24 * bs, generator=gen)[:t]
    slots[5] = -1
    pool = torch.zeros(24, 2, 2, bs, kvh, d, dtype=cache_dtype)
    ref_pool = pool.clone()
    key, value = _pool_views(pool, 1)
    q = rope_store(qkv, pos, fused.cos_sin, key, value, slots, h, kvh)
    x = qkv.float().clone()
    q_ref, k_ref = x[:, : h * d], x[:, h * d : (h + kvh) * d]
    torch.ops._C.rotary_embedding(pos, q_ref, k_ref, d, fused.cos_sin, True)
    x = x.to(cache_dtype)
    keep = slots >= 0
    ref_key, ref_value = _pool_views(ref_pool, 1)
    torch.ops._C.cpu_attn_reshape_and_cache(
        x[keep, h * d : (h + kvh) * d].reshape(-1, kvh, d),
        x[keep, (h + kvh) * d :].reshape(-1, kvh, d),
        ref_key,
        ref_value,
        slots[keep],
        "vec16",
    )
    assert q.dtype == cache_dtype and q.shape == (t, h, d)
    assert torch.equal(q, x[:, : h * d].view(t, h, d))
    assert torch.equal(pool, ref_pool) and pool[:, 1].any() and not pool[:, 0].any()


def test_rope_store_refuses_what_it_cannot_take(fused: FusedCpuBackend) -> None:
    rope_store = rope_store_op()
    if rope_store is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    pool = torch.zeros(4, 1, 2, 16, 3, 64)
    key, value = _pool_views(pool, 0)
    qkv, slots = torch.randn(2, 15 * 64), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="position out of range"):
        rope_store(qkv, torch.tensor([0, 512]), fused.cos_sin, key, value, slots, 9, 3)
    with pytest.raises(RuntimeError, match="slot out of range"):
        rope_store(qkv, torch.tensor([0, 1]), fused.cos_sin, key, value, slots * 64, 9, 3)
    with pytest.raises(RuntimeError, match="width"):
        rope_store(qkv[:, :-64], torch.tensor([0, 1]), fused.cos_sin, key, value, slots, 9, 3)
    assert not pool.any()


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


def _runner(path: Path, backend: str, dtype: str, quantization: str = "none") -> ModelRunner:
    runner = build_engine(
        EngineConfig(
            model=str(path),
            quantization=quantization,
            num_kv_blocks=64,
            attention_backend=backend,
            dtype=dtype,
        )
    ).runner
    assert type(runner.backend) is (TorchBackend if backend == "torch" else FusedCpuBackend)
    return runner


def _run(
    path: Path, backend: str, dtype: str, runner: ModelRunner | None = None
) -> list[torch.Tensor]:
    """Chunked prefill of 3 prompts (fresh chunks, then chunks after earlier ones), then 5
    batched decode steps of teacher-forced tokens: every step's logits."""
    runner = runner or _runner(path, backend, dtype)
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
    return logits


def test_forward_equals_torch_backend(fused: FusedCpuBackend, smollm2: Path) -> None:
    """float32 (SmolLM2: head size 64, which the library's attention takes; the tiny
    checkpoints' 16 it does not, and they run the torch backend): prefill, continued
    chunks and decode, attention over the pool in place."""
    want = _run(smollm2, "torch", "float32")
    got = _run(smollm2, "auto", "float32")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_rope_store_leaves_the_packed_forwards_bits(fused: FusedCpuBackend, smollm2: Path) -> None:
    """The packed default with pdserve's one-pass rotary + K/V store and without it (the
    library's four ops): every logit of prefill, continued chunks and decode the same."""
    if rope_store_op() is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    one_pass = _runner(smollm2, "auto", "float32", quantization="auto")
    four_ops = _runner(smollm2, "auto", "float32", quantization="auto")
    assert isinstance(one_pass.backend, FusedCpuBackend) and one_pass.backend._rope_store
    assert isinstance(four_ops.backend, FusedCpuBackend)
    four_ops.backend._rope_store = None
    for a, b in zip(_run(smollm2, "", "", one_pass), _run(smollm2, "", "", four_ops)):
        assert torch.equal(a, b)


def test_bfloat16_forward_as_close_to_float32_as_torch(
    fused: FusedCpuBackend, smollm2: Path
) -> None:
    """In bfloat16 the backends round differently (a step's logits ~0.3-0.5 apart at
    worst, either one nearer the float32 forward), so each is set against the float32
    forward over all steps: the fused one's mean error is no more than the torch one's
    + 50 % (seen: +12 %)."""
    ref = torch.cat(_run(smollm2, "torch", "float32"))
    err_torch = (torch.cat(_run(smollm2, "torch", "bfloat16")) - ref).abs().mean()
    err_fused = (torch.cat(_run(smollm2, "auto", "bfloat16")) - ref).abs().mean()
    assert err_fused <= 1.5 * err_torch, (float(err_fused), float(err_torch))


def test_verification_rows_get_their_decode_steps_bits(
    fused: FusedCpuBackend, smollm2: Path
) -> None:
    """Speculative verification runs each query row as a request of its own, so a row's
    logits are exactly those of the decode step that would have run it (on the packed
    default, whose decode kernels give a row the same bits whatever rows run beside it;
    float32 GEMMs do not, on either backend)."""
    prompt = list(range(300, 340))
    drafts = [11, 12, 13]
    stepped = _runner(smollm2, "auto", "float32", quantization="auto")
    seq = Sequence(0, prompt, sampling=SamplingParams())
    stepped.prefill([(seq, seq.num_tokens)])
    seq.output_ids.append(10)
    want = []
    for token in drafts:
        want.append(stepped.decode([seq])[0])
        seq.output_ids.append(token)
    want.append(stepped.decode([seq])[0])
    verifying = _runner(smollm2, "auto", "float32", quantization="auto")
    other = Sequence(1, prompt, sampling=SamplingParams())
    verifying.prefill([(other, other.num_tokens)])
    other.output_ids.append(10)
    got = verifying.verify([other], [drafts])
    assert torch.equal(got, torch.stack(want))


def test_greedy_tokens_same_alone_and_in_a_batch(fused: FusedCpuBackend, smollm2: Path) -> None:
    """The packed default: a request's greedy tokens do not depend on the batch beside it
    up to the decode kernel switch (12 rows here: ``gemm_min_rows``), so a batch of 8."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49000, (5 + 9 * i,), generator=g).tolist() for i in range(8)]
    llm = LLM(EngineConfig(model=str(smollm2), num_kv_blocks=128))
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts, greedy)
    for i in (0, 7):
        assert llm.generate([prompts[i]], greedy)[0].output_ids == batch[i].output_ids


def test_backend_follows_the_head_sizes_the_library_takes(
    fused: FusedCpuBackend, tiny_model_path: Path
) -> None:
    """Heads of 16 (tiny llama, qwen2): no library kernels, the torch backend; of 32 (tiny
    qwen3): the fused one, which the parity tests against transformers then run."""
    runner = build_engine(EngineConfig(model=str(tiny_model_path), num_kv_blocks=8)).runner
    head_dim = runner.model_config.head_dim
    assert type(runner.backend) is (TorchBackend if head_dim == 16 else FusedCpuBackend)


def test_torch_backend_forced_or_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    forced = cpu_backend("torch", _geometry(16))
    assert type(forced) is TorchBackend and forced.dense is not None
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "off")
    with pytest.raises(vllm_cpu.CpuKernelsUnavailable, match="PDSERVE_CPU_KERNELS"):
        vllm_cpu.load()
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "/nonexistent")
    if vllm_cpu.cpu_isa() is not None:
        with pytest.raises(vllm_cpu.CpuKernelsUnavailable, match="not found"):
            vllm_cpu.load()


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
        assert vllm_cpu.cpu_isa() == want
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert vllm_cpu.cpu_isa() is None


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norms"])
def test_attend_takes_the_kernels_bfloat16_with_the_bits_of_float32(
    fused: FusedCpuBackend, smollm2: Path, monkeypatch: pytest.MonkeyPatch, qk_norm: bool
) -> None:
    """``takes_kernel_dtype``: q, k, v straight from a packed kernel (bfloat16) give the
    output and pool bytes that the same values widened to the model's float32 give (the
    widening is exact; rotary and Qwen3's per-head norms run in float32 either way). On
    torch's int4 kernel, whose products come out in bfloat16 (pdserve's are float32)."""
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "torch")
    runner = _runner(smollm2, "auto", "float32", quantization="auto")
    attn = runner.model.layer(0).attn
    if qk_norm:
        attn.q_norm, attn.k_norm = (
            _norm(attn.head_dim, torch.float32),
            _norm(attn.head_dim, torch.float32),
        )
    seen: list[tuple[torch.Tensor, torch.Tensor, object]] = []
    attend = FusedCpuBackend.attend

    def spy(
        self: FusedCpuBackend, layer: object, qkv: torch.Tensor, pool: torch.Tensor, meta: object
    ) -> torch.Tensor:
        if layer is attn:
            seen.append((qkv.clone(), pool.clone(), meta))
        return attend(self, layer, qkv, pool, meta)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedCpuBackend, "attend", spy)
    seqs = [
        Sequence(i, list(range(300 + i, 340 + 3 * i)), sampling=SamplingParams()) for i in range(3)
    ]
    runner.prefill([(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.output_ids.append(10)
    runner.decode(seqs)
    monkeypatch.undo()
    backend = runner.backend
    assert len(seen) == 2
    for qkv, pool, meta in seen:  # the prefill's and the decode's
        assert qkv.dtype == torch.bfloat16  # the packed projection's own
        wide_pool = pool.clone()
        got = backend.attend(attn, qkv.clone(), pool, meta)  # type: ignore[arg-type]
        want = backend.attend(attn, qkv.float(), wide_pool, meta)  # type: ignore[arg-type]
        assert torch.equal(got, want) and torch.equal(pool, wide_pool)


def _dense_attention(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables: torch.Tensor, lens: list[int]
) -> torch.Tensor:
    """float64 softmax(q K^T / sqrt(D)) V per row, K and V gathered from ``vec16`` blocks
    (per block and KV head: K as (D, block_size), V as (block_size, D))."""
    b, h, d = q.shape
    _, kvh, bs, _ = key.shape
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // bs)].long()
        k = key[blocks].reshape(len(blocks), kvh, d, bs).permute(1, 0, 3, 2)
        v = value[blocks].reshape(len(blocks), kvh, bs, d).permute(1, 0, 2, 3)
        k, v = k.reshape(kvh, -1, d)[:, :n].double(), v.reshape(kvh, -1, d)[:, :n].double()
        for j in range(h):
            g = j // (h // kvh)
            out[i, j] = torch.softmax(q[i, j].double() @ k[g].T * d**-0.5, -1) @ v[g]
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "kvh", "d", "bs"), [(9, 3, 64, 16), (8, 1, 128, 32), (4, 4, 64, 16)])
def test_decode_attention_equals_softmax_attention_and_a_rows_bits_stay(
    fused: FusedCpuBackend, cache_dtype: torch.dtype, h: int, kvh: int, d: int, bs: int
) -> None:
    """pdserve's decode attention (one query row a sequence, over the pool in place): within
    one rounding of the cache's dtype of float64 attention over the gathered context, and
    of the library's kernel; contexts of 1 to 700 tokens across scattered blocks (past 512
    a row's context is taken in two halves, then merged); each row's bits the same alone, in any batch and on 1 or 2 threads (a decode
    step and a speculative verification of the same row agree), and with the context
    prefetched into L1 or L2 (each CPU takes one: both run here)."""
    op = decode_attention_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    gen = torch.Generator().manual_seed(h + d)
    lens = [300, 1, 16, 17, 15, 129, 700, 513]  # past 512 tokens a row is split in two
    width = -(-max(lens) // bs)
    pool = torch.randn(len(lens) * width + 3, 2, 2, bs, kvh, d, generator=gen).to(cache_dtype)
    key, value = _pool_views(pool, 1)
    tables = torch.randperm(pool.shape[0], generator=gen)[: len(lens) * width]
    tables = tables.view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), h, d, generator=gen).to(cache_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = op(q, key, value, tables, seq_lens, d**-0.5)
    assert got.dtype == cache_dtype and got.shape == q.shape
    want = _dense_attention(q, key, value, tables, lens)
    atol, rtol = TOL[cache_dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    if h // kvh <= 8 and d == 64:  # the library's kernel takes these heads too
        starts = torch.arange(len(lens) + 1, dtype=torch.int32)
        lib = _library_attention(q, key, value, starts, seq_lens, tables)
        torch.testing.assert_close(got.double(), lib.double(), atol=atol, rtol=rtol)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for i in range(len(lens)):
                alone = op(
                    q[i : i + 1], key, value, tables[i : i + 1], seq_lens[i : i + 1], d**-0.5
                )
                assert torch.equal(alone[0], got[i]), (threads, i)
            assert torch.equal(op(q[2:], key, value, tables[2:], seq_lens[2:], d**-0.5), got[2:])
            for prefetch in (0, 1):
                again = op(q, key, value, tables, seq_lens, d**-0.5, None, prefetch)
                assert torch.equal(again, got), (threads, prefetch)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="prefetch must be -1, 0 or 1"):
        op(q, key, value, tables, seq_lens, d**-0.5, None, 2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "kvh", "d", "bs"), [(9, 3, 64, 16), (8, 1, 128, 32)])
def test_a_sequences_rows_together_get_each_rows_bits_alone(
    cache_dtype: torch.dtype, h: int, kvh: int, d: int, bs: int
) -> None:
    """Several query rows of one sequence (a speculative verification's k + 1, each over
    its own length of the same context) in one call, given one block table, get each row's
    bits alone, a decode step of its length: runs of 1 to 12 rows (the workers' runs cut
    inside a sequence, and a core's groups of at most 8 rows), across the 16-token chunks
    and the two halves a row past 512 tokens is split into, on 1 and 2 threads."""
    op = decode_attention_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    gen = torch.Generator().manual_seed(7 * h + d)
    # (first row's length, rows): each run's rows see 1, 2, ... more tokens than the first
    runs = [(40, 5), (1, 3), (505, 12), (511, 2), (700, 9), (16, 1)]
    width = -(-max(n + r for n, r in runs) // bs)
    pool = torch.randn(len(runs) * width + 2, 1, 2, bs, kvh, d, generator=gen).to(cache_dtype)
    key, value = _pool_views(pool, 0)
    tables = torch.randperm(pool.shape[0], generator=gen)[: len(runs) * width]
    tables = tables.view(len(runs), width).to(torch.int32)
    lens = [n + j for n, r in runs for j in range(r)]
    starts = [0]
    for _, r in runs:
        starts.append(starts[-1] + r)
    q = torch.randn(len(lens), h, d, generator=gen).to(cache_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_starts = torch.tensor(starts, dtype=torch.int32)
    row_tables = tables[[s for s, (_, r) in enumerate(runs) for _ in range(r)]].contiguous()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = op(q, key, value, tables, seq_lens, d**-0.5, q_starts)
            alone = op(q, key, value, row_tables, seq_lens, d**-0.5)  # each row its own
            assert torch.equal(got, alone), threads
            for i in (0, 7, 11, len(lens) - 1):
                one = op(
                    q[i : i + 1], key, value, row_tables[i : i + 1], seq_lens[i : i + 1], d**-0.5
                )
                assert torch.equal(one[0], got[i]), (threads, i)
    finally:
        torch.set_num_threads(before)
    want = _dense_attention(q, key, value, row_tables, lens)
    atol, rtol = TOL[cache_dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def _small_case(
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-block bfloat16 pool of one layer (9 heads over 3 of 64), its K and V views,
    ``rows`` query rows and one sequence's table of blocks 0 and 1: the refusal tests'."""
    pool = torch.zeros(4, 1, 2, 16, 3, 64, dtype=torch.bfloat16)
    key, value = _pool_views(pool, 0)
    q = torch.zeros(rows, 9, 64, dtype=torch.bfloat16)
    return pool, key, value, q, torch.tensor([[0, 1]], dtype=torch.int32)


def test_decode_attention_refuses_what_it_cannot_take(fused: FusedCpuBackend) -> None:
    """Bad lengths, blocks outside the pool, and shapes it was not built for are errors,
    never reads outside the pool."""
    op = decode_attention_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    _, key, value, q, tables = _small_case(rows=1)
    with pytest.raises(RuntimeError, match="has 33 tokens for 2 blocks"):
        op(q, key, value, tables, torch.tensor([33], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="has 0 tokens"):
        op(q, key, value, tables, torch.tensor([0], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="names block 7"):
        op(
            q,
            key,
            value,
            torch.tensor([[0, 7]], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32),
            0.125,
        )
    with pytest.raises(RuntimeError, match="cache's dtype"):
        op(q.float(), key, value, tables, torch.tensor([5], dtype=torch.int32), 0.125)
    two = torch.tensor([5, 6], dtype=torch.int32)
    for starts, match in (
        ([0, 1], "from 0 to the 2 rows"),
        ([1, 2], "from 0 to the 2 rows"),
        ([0, 2, 1, 2], "must not decrease"),
    ):
        with pytest.raises(RuntimeError, match=match):
            op(
                torch.zeros(2, 9, 64, dtype=torch.bfloat16),
                key,
                value,
                tables.expand(len(starts) - 1, 2).contiguous(),
                two,
                0.125,
                torch.tensor(starts, dtype=torch.int32),
            )
    with pytest.raises(RuntimeError, match="q_starts must be int32"):
        op(q, key, value, tables, torch.tensor([5], dtype=torch.int32), 0.125, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="names block 7"):  # the longest row's blocks
        op(
            torch.zeros(2, 9, 64, dtype=torch.bfloat16),
            key,
            value,
            torch.tensor([[0, 7]], dtype=torch.int32),
            torch.tensor([16, 17], dtype=torch.int32),
            0.125,
            torch.tensor([0, 2], dtype=torch.int32),
        )
    with pytest.raises(RuntimeError, match="heads a KV head is not built"):
        op(
            torch.zeros(1, 30, 64, dtype=torch.bfloat16),
            key,
            value,
            tables,
            torch.tensor([5], dtype=torch.int32),
            0.125,
        )


def _library_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
) -> torch.Tensor:
    """The library's causal attention over the same pool, as the fused backend calls it."""
    b, (h, d), kvh = len(seq_lens), q.shape[1:], key.shape[1]
    schedule = torch.ops._C.get_scheduler_metadata(
        b, h, kvh, d, seq_lens, q.dtype, starts, True, -1, "vec16", False, None
    )
    out = torch.empty_like(q)
    torch.ops._C.cpu_attention_with_kv_cache(
        q, key, value, out, starts, seq_lens, d**-0.5, True, None, -1, tables, 0.0, schedule,
        None, None,
    )  # fmt: skip
    return out


def _causal_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    q_lens: list[int],
) -> torch.Tensor:
    """float64 causal attention of each sequence's last ``q_lens[b]`` of ``lens[b]`` tokens,
    its rows one after another in ``q`` (T, H, D); K and V gathered as ``_dense_attention``."""
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for b, (n, rows) in enumerate(zip(lens, q_lens, strict=True)):
        for i in range(rows):
            one = _dense_attention(
                q[row + i : row + i + 1], key, value, tables[b : b + 1], [n - rows + i + 1]
            )
            out[row + i] = one[0]
        row += rows
    return out


def _prefill_case(
    h: int, kvh: int, d: int, bs: int, lens: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bfloat16 pool and scattered block tables for ``lens``; past each sequence's last
    token its last block holds NaN (a slot not written yet may hold anything)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // bs)
    pool = torch.randn(len(lens) * width + 3, 2, 2, bs, kvh, d, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(pool.shape[0], generator=gen)[: len(lens) * width]
    tables = tables.view(len(lens), width).to(torch.int32)
    key, value = _pool_views(pool, 1)
    for b, n in enumerate(lens):
        if n % bs:
            last = int(tables[b, n // bs])
            key[last].view(kvh, d, bs)[:, :, n % bs :] = float("nan")  # K: (D, bs) a head
            value[last][:, n % bs :] = float("nan")
    return pool, tables, gen


def _starts(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(("h", "kvh", "d", "bs"), [(9, 3, 64, 16), (8, 1, 128, 32), (4, 4, 64, 16)])
def test_prefill_attention_equals_causal_attention_and_a_rows_bits_stay(
    fused: FusedCpuBackend, h: int, kvh: int, d: int, bs: int
) -> None:
    """pdserve's prefill attention (any query rows, causal, over a bfloat16 pool in place):
    within one bfloat16 rounding of float64 attention and of the library's kernel, for whole
    prompts, a chunked prompt's later rows, single rows and lengths around its 32-token
    chunks and 16-row tasks; each row's bits the same alone, in another batch, with its
    prompt split differently, and on 1 or 2 threads."""
    op = prefill_attention_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    lens, q_lens = [300, 1, 17, 40, 130, 64], [300, 1, 5, 33, 64, 31]
    pool, tables, gen = _prefill_case(h, kvh, d, bs, lens, h + d)
    key, value = _pool_views(pool, 1)
    q = (2 * torch.randn(sum(q_lens), h, d, generator=gen)).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = op(q, key, value, _starts(q_lens), seq_lens, tables, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = _causal_attention(q, key, value, tables, lens, q_lens)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    if d == 64:  # the library's kernel takes these heads too (not the NaN: its 0 x NaN is NaN)
        key, value = _pool_views(pool.nan_to_num(), 1)
        lib = _library_attention(q, key, value, _starts(q_lens), seq_lens, tables)
        torch.testing.assert_close(got.double(), lib.double(), atol=atol, rtol=rtol)
        key, value = _pool_views(pool, 1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            row = 0
            for b, rows in enumerate(q_lens):  # each sequence alone
                alone = op(
                    q[row : row + rows],
                    key,
                    value,
                    _starts([rows]),
                    seq_lens[b : b + 1],
                    tables[b : b + 1],
                    d**-0.5,
                )
                assert torch.equal(alone, got[row : row + rows]), (threads, b)
                row += rows
            # The 300-token prompt chunked as 37 + 263 rows: the later chunk's rows alike.
            later = op(q[37:300], key, value, _starts([263]), seq_lens[:1], tables[:1], d**-0.5)
            assert torch.equal(later, got[37:300]), threads
    finally:
        torch.set_num_threads(before)


def test_prefill_attention_refuses_what_it_cannot_take(fused: FusedCpuBackend) -> None:
    """Bad lengths and row spans, blocks outside the pool, a float32 pool and head sizes it
    was not built for are errors, never reads outside the pool."""
    op = prefill_attention_op()
    if op is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")
    pool, key, value, q, tables = _small_case(rows=4)

    def call(q=q, key=key, value=value, starts=(0, 4), lens=(20,), tables=tables):  # type: ignore[no-untyped-def]
        starts_t = torch.tensor(starts, dtype=torch.int32)
        return op(q, key, value, starts_t, torch.tensor(lens, dtype=torch.int32), tables, 0.125)

    with pytest.raises(RuntimeError, match="4 query rows, 33 tokens, 2 blocks"):
        call(lens=(33,))
    with pytest.raises(RuntimeError, match="4 query rows, 3 tokens"):
        call(lens=(3,))
    with pytest.raises(RuntimeError, match="q_starts must run from 0 to the 4 rows"):
        call(starts=(0, 3))
    with pytest.raises(RuntimeError, match="names block 7"):
        call(tables=torch.tensor([[0, 7]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="q must be contiguous bfloat16"):
        call(q=q.float())
    fkey, fvalue = _pool_views(pool.float(), 0)
    with pytest.raises(RuntimeError, match="K and V must be bfloat16"):
        call(key=fkey, value=fvalue)
    with pytest.raises(RuntimeError, match="heads 30 over 3"):
        call(q=torch.zeros(4, 30, 64, dtype=torch.bfloat16))
    small = torch.zeros(4, 1, 2, 16, 3, 32, dtype=torch.bfloat16)
    skey, svalue = _pool_views(small, 0)
    with pytest.raises(RuntimeError, match="head size 32 is not built"):
        call(q=torch.zeros(4, 9, 32, dtype=torch.bfloat16), key=skey, value=svalue)


def test_steps_pick_the_attention_for_their_rows_and_pool(fused: FusedCpuBackend) -> None:
    """One row a request: pdserve's decode kernel; other steps on a bfloat16 pool: its
    prefill kernel; on a float32 pool: the library's (with its schedule)."""
    if decode_attention_op() is None or prefill_attention_op() is None:
        pytest.skip("pdserve's CPU kernels are not built or do not run here")

    def meta(q_lens: list[int], ctx_lens: list[int]) -> AttentionMetadata:
        t = sum(q_lens)
        return AttentionMetadata(
            block_tables=torch.zeros(len(q_lens), 4, dtype=torch.int64),
            ctx_lens=ctx_lens,
            q_lens=q_lens,
            is_decode=all(n == 1 for n in q_lens),
            positions=torch.zeros(t, dtype=torch.int64),
            slots=torch.zeros(t, dtype=torch.int64),
        )

    for dtype, prompt_kernel in ((torch.bfloat16, "prefill"), (torch.float32, "library")):
        pool = torch.zeros(8, 1, 2, 16, 3, 64, dtype=dtype)
        decode = fused.prepare(meta([1, 1], [5, 9]), pool, 9).paged
        prompt = fused.prepare(meta([4, 1], [4, 9]), pool, 9).paged
        assert isinstance(decode, PagedBatch) and isinstance(prompt, PagedBatch)
        assert decode.kernel == "decode" and decode.schedule is None
        assert prompt.kernel == prompt_kernel
        assert (prompt.schedule is not None) == (prompt_kernel == "library")
