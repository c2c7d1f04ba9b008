"""The runner on the kernel path (Triton; CPU interpreter here) equals the torch path.

Also pins what the CUDA path promises per step: one host -> device copy, block tables
sent only as the blocks that are new, padded graph-bucket batches equal to unpadded ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bundled_models import tiny
from colocated.llm import LLM
from engine.build import build_engine
from engine.config import EngineConfig
from engine.cuda.graphs import StepArrays, StepInputs
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from tests.engine.kernels.conftest import DEVICE
from wire.params import SamplingParams

PROMPT_LENS = [1, 17, 33]  # a lone token, a block and one, two blocks and one
CHUNK = 16


def _runners(path: Path, **kw: Any) -> tuple[ModelRunner, ModelRunner]:
    """(kernel path, torch path) over the same checkpoint."""
    common: dict[str, Any] = {
        "model": str(path),
        "num_kv_blocks": 48,
        "max_num_seqs": 8,
        "device": DEVICE.type,
        **kw,
    }
    kernel = build_engine(EngineConfig(attention_backend="triton", **common)).runner
    torch_ = build_engine(EngineConfig(attention_backend="torch", **common)).runner
    assert kernel._kernels is not None and torch_._kernels is None
    return kernel, torch_


def _prompts(lens: list[int] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 151_000, (n,), generator=g).tolist() for n in lens]


def _run(runner: ModelRunner, steps: int, lens: list[int] = PROMPT_LENS) -> list[torch.Tensor]:
    """Chunked prefill of every prompt (chunks of CHUNK, batched), then decode steps."""
    seqs = [Sequence(i, p) for i, p in enumerate(_prompts(lens))]
    out = []
    while pending := [s for s in seqs if s.num_uncomputed_tokens > 0]:
        out.append(runner.prefill([(s, min(CHUNK, s.num_uncomputed_tokens)) for s in pending]))
    for step in range(steps):
        for s in seqs:
            s.output_ids.append(1000 + step)
        out.append(runner.decode(seqs))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qkv bias; per-head q/k norm
def test_prefill_and_decode_logits_match_the_torch_path(arch: str) -> None:
    kernel, torch_ = _runners(tiny.tiny_model_dir(arch))
    for got, want in zip(_run(kernel, steps=2), _run(torch_, steps=2), strict=True):
        torch.testing.assert_close(got, want.to(got.device), atol=1e-4, rtol=0)


def test_padded_graph_buckets_match_the_torch_path(default_model_path: Path) -> None:
    """The graph path's inputs on CPU: 3 rows padded to bucket 4, KV split 4 ways."""
    kernel, torch_ = _runners(default_model_path)
    path = kernel._kernels
    assert path is not None
    ran: list[int] = []
    path.graphs = _EagerGraphs(path._graph_forward, ran)  # type: ignore[assignment]
    path._num_sms = 16  # as on a (small) GPU: 2 * 16 programs wanted, 4 * 2 rows -> 4 splits
    lens = [1, 17, 3]  # decode is what differs here: short prompts
    for got, want in zip(_run(kernel, 2, lens), _run(torch_, 2, lens), strict=True):
        torch.testing.assert_close(got, want.to(got.device), atol=1e-4, rtol=0)
    assert ran == [4, 4]


def test_greedy_generation_is_token_identical(default_model_path: Path) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    results = []
    for backend in ("triton", "torch"):
        llm = LLM(
            EngineConfig(
                model=str(default_model_path),
                num_kv_blocks=32,
                device=DEVICE.type,
                attention_backend=backend,
            )
        )
        results.append([r.output_ids for r in llm.generate(_prompts()[:2], params)])
    assert results[0] == results[1]


def test_a_decode_step_makes_one_host_to_device_copy_and_sends_only_new_blocks(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = build_engine(
        EngineConfig(
            model=str(default_model_path),
            num_kv_blocks=16,
            device=DEVICE.type,
            attention_backend="triton",
        )
    ).runner
    seqs = [Sequence(0, list(range(10, 25))), Sequence(1, list(range(30, 33)))]  # 15, 3 tokens
    runner.prefill([(s, s.num_tokens) for s in seqs])
    staged: list[int] = []
    stage = StepInputs.stage

    def spy(self: StepInputs, arrays: StepArrays, updates: list[int]) -> None:
        staged.append(len(updates) // 2)  # (flat index, block) pairs sent this step
        stage(self, arrays, updates)

    monkeypatch.setattr(StepInputs, "stage", spy)
    for _ in range(2):  # step 0 fills token 16 of seq 0; step 1 needs its second block
        for s in seqs:
            s.output_ids.append(7)
        with _HostTransfers() as transfers:
            runner.decode(seqs)
        assert transfers.calls == ["copy_"], transfers.calls  # StepInputs.stage's one copy
    assert staged == [0, 1]  # no table rebuilt: only seq 0's new block, once
    live = runner._kernels.rows.num_live if runner._kernels else -1
    runner.kv.free_blocks(seqs[0])
    assert runner._kernels is not None and runner._kernels.rows.num_live == live - 1


class _EagerGraphs:
    """Stands in for DecodeGraphs off CUDA: the same padded buckets, run without capture."""

    def __init__(self, forward: Callable[[int], torch.Tensor], ran: list[int]) -> None:
        self.forward, self.ran = forward, ran

    def run(self, bucket: int, key: object) -> torch.Tensor:
        self.ran.append(bucket)
        return self.forward(bucket)


class _HostTransfers(TorchFunctionMode):
    """Records calls that move or build tensors from host data, outside triton itself
    (the interpreter copies kernel arguments to and from numpy on every launch)."""

    WATCHED: ClassVar[set[object]] = {
        torch.tensor,
        torch.as_tensor,
        torch.Tensor.to,
        torch.Tensor.cuda,
        torch.Tensor.copy_,
        torch.Tensor.pin_memory,
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in self.WATCHED and not _inside_triton():
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _inside_triton() -> bool:
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton."):
            return True
        frame = frame.f_back
    return False
