"""A decode step's layers in one call (``decode_layers``, engine/model/fused_layers.py) give
the bits the layer loop gives, on the packed default model the fused CPU backend serves.

Skipped where pdserve's kernels or the kernel library do not run (no AVX-512 BF16): the
layer loop is then the only path, and every other test runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bundled_models.default_model import resolve_model
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kernels import vllm_cpu
from engine.kernels.cpu.ops import decode_layers_op
from engine.kv.sequence import Sequence
from engine.model.fused_cpu import FusedCpuBackend
from engine.model.fused_layers import layer_stack
from engine.runner import ModelRunner
from engine.weights import int4_tiles
from wire.params import SamplingParams


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if vllm_cpu.available() is None or decode_layers_op() is None:
        pytest.skip("the fused CPU backend or pdserve's kernels do not run here")
    return resolve_model(None)


def _runner(path: Path, quantization: str = "auto", **kw: Any) -> ModelRunner:
    runner = build_engine(
        EngineConfig(model=str(path), quantization=quantization, num_kv_blocks=64, **kw)
    ).runner
    assert isinstance(runner.backend, FusedCpuBackend)
    return runner


def _counted(backend: FusedCpuBackend) -> list[int]:
    """Counts the op's calls on ``backend``: [calls]."""
    calls = [0]
    op = backend.decode_layers_op
    assert op is not None

    def counting(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return op(*args)

    backend.decode_layers_op = counting
    return calls


def _steps(
    runner: ModelRunner, run: Callable[[ModelRunner, list[Sequence]], torch.Tensor]
) -> list[torch.Tensor]:
    """Chunked prefill of 3 prompts, then 6 decode steps of teacher-forced tokens (one
    sequence leaves after 3), and ``run``'s logits after."""
    g = torch.Generator().manual_seed(0)
    seqs = [
        Sequence(i, torch.randint(0, 1000, (n,), generator=g).tolist(), sampling=SamplingParams())
        for i, n in enumerate((7, 40, 300))
    ]
    logits = [runner.prefill([(s, min(16, s.num_tokens)) for s in seqs])]
    logits.append(runner.prefill([(s, s.num_uncomputed_tokens) for s in seqs[1:]]))
    for step in range(6):
        batch = seqs if step < 3 else seqs[1:]
        for s in batch:
            s.output_ids.append(100 + step + s.rid)
        logits.append(runner.decode(batch))
    logits.append(run(runner, seqs))
    return logits


def _verify(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    for s in seqs[1:]:
        s.output_ids.append(50)
    return runner.verify(seqs[1:], [[11, 12, 13], [21, 22]])


@pytest.mark.parametrize("kernel", ["avx512_bf16", "avx512_vnni"])
@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_one_call_gives_the_layer_loops_bits(
    smollm2: Path, quantization: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of 3 and 2 rows and a speculative verification (k + 1 rows a
    sequence): every logit equal, the one call taken for each of them and for no prefill;
    on int4 layers and on int8 ones (two nibble planes each), on bfloat16 inputs and on
    int8 ones (``avx512_vnni``)."""
    if kernel not in int4_tiles.available_kernels():
        pytest.skip(f"the {kernel} int4 kernel does not run here")
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", kernel)
    one_call, loop = _runner(smollm2, quantization), _runner(smollm2, quantization)
    stack = layer_stack(one_call.model)
    assert stack is not None and stack.a8 == (kernel == "avx512_vnni")
    calls = _counted(one_call.backend)  # type: ignore[arg-type]
    assert isinstance(loop.backend, FusedCpuBackend)
    loop.backend.decode_layers_op = None
    got, want = _steps(one_call, _verify), _steps(loop, _verify)
    assert calls[0] == 7  # the 6 decode steps and the verification
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_batch_invariant_serving_takes_it_for_prompts_too(smollm2: Path) -> None:
    """``--enable-deterministic-inference``: every linear layer stays packed and a prompt's
    rows attend as decode rows, so prefills take the one call too, with the loop's bits."""
    one_call = _runner(smollm2, deterministic=True)
    loop = _runner(smollm2, deterministic=True)
    calls = _counted(one_call.backend)  # type: ignore[arg-type]
    assert isinstance(loop.backend, FusedCpuBackend)
    loop.backend.decode_layers_op = None
    got, want = _steps(one_call, _verify), _steps(loop, _verify)
    assert calls[0] == 9
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_dense_or_many_row_layers_run_the_loop(smollm2: Path) -> None:
    """float32 weights are not its case; a decode batch from the many-rows crossover on
    takes the GEMMs, and the loop."""
    assert layer_stack(_runner(smollm2, "none").model) is None
    runner = _runner(smollm2, large_batch_gemm=True, gemm_min_rows=2)
    calls = _counted(runner.backend)  # type: ignore[arg-type]
    seqs = [Sequence(i, [5 + i, 6, 7], sampling=SamplingParams()) for i in range(2)]
    runner.prefill([(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.output_ids.append(9)
    runner.decode(seqs)
    seqs[0].output_ids.append(10)
    runner.decode(seqs[:1])
    assert calls[0] == 1  # the one-row step
