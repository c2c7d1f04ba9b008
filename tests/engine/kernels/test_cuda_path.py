"""The kernel path on a real GPU: graphs replay what eager runs, in bf16 too, with no host
sync in a decode step. Skipped without CUDA (the CPU tests cover the same code under the
interpreter, except graph capture and compiled kernels)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
PROMPT_LENS = [1, 17, 33, 100, 5]


def _logits(runner: ModelRunner, steps: int) -> list[torch.Tensor]:
    seqs = [Sequence(i, list(range(100 + i, 100 + i + n))) for i, n in enumerate(PROMPT_LENS)]
    out = [runner.prefill([(s, s.num_tokens) for s in seqs]).float().cpu()]
    for step in range(steps):
        for s in seqs:
            s.output_ids.append(500 + step)
        out.append(runner.decode(seqs).float().cpu())
    return out


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 2e-3), ("bfloat16", 5e-2)])
def test_graphs_eager_kernels_and_torch_agree(
    default_model_path: Path, dtype: str, tol: float
) -> None:
    def runner(**kw: object) -> ModelRunner:
        return build_engine(
            EngineConfig(
                model=str(default_model_path),
                device="cuda",
                dtype=dtype,
                num_kv_blocks=64,
                max_num_seqs=16,
                **kw,
            )
        ).runner  # type: ignore[arg-type]

    graphs = runner()
    results = {
        "graphs": _logits(graphs, steps=4),
        "eager": _logits(runner(enforce_eager=True), steps=4),
        "torch": _logits(runner(attention_backend="torch"), steps=4),
    }
    assert graphs._kernels is not None and graphs._kernels.graphs is not None
    assert graphs._kernels.graphs.captured == [8]  # 5 rows -> bucket 8, captured once
    # Same kernels in the same order, but a graph runs its bucket's padded rows (8 for 5),
    # and cuBLAS may pick another GEMM kernel for 8 rows than for 5: in float32 the two
    # agree to 1e-5, in bfloat16 to its rounding (measured on an H200: 6e-3 at most).
    exact = 1e-5 if dtype == "float32" else tol
    for got, want in zip(results["graphs"], results["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=exact, rtol=0 if exact < tol else tol)
    for got, want in zip(results["eager"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_graphs_captured_before_serving_write_no_kv_and_replay_what_eager_runs(
    default_model_path: Path,
) -> None:
    """A decode worker captures every bucket at startup on padding rows: the pool keeps
    every byte, and the later steps replay those graphs (none recaptured), equal to eager."""

    def runner(**kw: object) -> ModelRunner:
        config = EngineConfig(
            model=str(default_model_path), device="cuda", num_kv_blocks=64, max_num_seqs=16
        )
        return build_engine(replace(config, **kw)).runner  # type: ignore[arg-type]

    graphs = runner()
    before = graphs.kv.tensor.view(torch.uint8).clone()
    graphs.capture_decode_graphs()
    assert graphs._kernels is not None and graphs._kernels.graphs is not None
    assert graphs._kernels.graphs.captured == [1, 2, 4, 8, 16]
    assert torch.equal(graphs.kv.tensor.view(torch.uint8), before)
    got, want = _logits(graphs, steps=4), _logits(runner(enforce_eager=True), steps=4)
    assert graphs._kernels.graphs.captured == [1, 2, 4, 8, 16]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_a_graph_decode_step_never_syncs_with_the_host(default_model_path: Path) -> None:
    """decode() only launches work; the step's one sync is the sampler's copy of tokens."""
    runner = build_engine(
        EngineConfig(
            model=str(default_model_path), device="cuda", num_kv_blocks=64, max_num_seqs=16
        )
    ).runner
    seqs = [Sequence(i, list(range(10, 10 + 20 * (i + 1)))) for i in range(3)]
    logits = runner.prefill([(s, s.num_tokens) for s in seqs])
    for step in range(3):  # step 0 captures the graph (capture synchronises); 1, 2 replay
        for s, token in zip(seqs, runner.sample(logits, seqs).token_ids.tolist()):
            s.append_token(token)
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            logits = runner.decode(seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
