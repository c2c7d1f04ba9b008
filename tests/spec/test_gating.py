"""The speculator's gates: batch size, measured acceptance, room; adaptive k."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig, SpeculativeConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.spec.proposer import Proposer
from engine.spec.speculator import Speculator
from wire.params import SamplingParams


class Fixed(Proposer):
    """Always offers k drafts (their value does not matter here)."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [[1] * k for k in ks]

    def release(self, rid: int) -> None:
        pass


def _setup(model: Path, **kw: int) -> tuple[Speculator, list[Sequence]]:
    runner = ModelRunner(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64))
    spec = Speculator(runner, SpeculativeConfig(**kw), Fixed())  # type: ignore[arg-type]
    seqs = [
        Sequence(
            rid=i,
            prompt_ids=[5, 6, 7],
            output_ids=[8],
            block_size=runner.block_size,
            sampling=SamplingParams(max_tokens=50),
            num_computed_tokens=3,
        )
        for i in range(3)
    ]
    return spec, seqs


def test_a_batch_above_the_gate_does_not_speculate(default_model_path: Path) -> None:
    spec, seqs = _setup(default_model_path, disable_by_batch_size=2)
    assert spec.drafts(seqs) is None
    assert spec.stats.skipped["batch_size"] == 3
    assert spec.drafts(seqs[:2]) == [[1] * 4, [1] * 4]


def test_k_follows_accepted_runs_and_rejection_backs_off(default_model_path: Path) -> None:
    spec, seqs = _setup(default_model_path, num_speculative_tokens=8)
    seq = seqs[0]
    assert spec.drafts([seq]) == [[1] * 8]
    spec.record(seq, 8, 2)  # rejected at the third draft: next time 3
    assert spec.drafts([seq]) == [[1] * 3]
    spec.record(seq, 3, 3)  # all accepted: doubles, up to the most allowed
    assert spec.drafts([seq]) == [[1] * 6]
    rejected = 0
    while (d := spec.drafts([seq])) is not None:  # keeps being rejected: k falls to 1 ...
        spec.record(seq, len(d[0]), 0)
        rejected += 1
        assert rejected < 10
    waits = 1  # ... and it stops proposing for a while (4 steps, then 8, 16 ... 64)
    while spec.drafts([seq]) is None:
        waits += 1
    assert waits == 4 and spec.stats.skipped["low_acceptance"] == 4
    assert spec.stats.accepted_per_pos[:3] == [2, 2, 1]


def test_no_draft_past_max_tokens_or_the_model_length(default_model_path: Path) -> None:
    spec, seqs = _setup(default_model_path)
    seq = seqs[0]
    seq.sampling = SamplingParams(max_tokens=3)  # 1 output so far: 2 more, 1 of them a draft
    assert spec.drafts([seq]) == [[1]]
    seq.sampling = SamplingParams(max_tokens=2)
    assert spec.drafts([seq]) is None and spec.stats.skipped["length"] == 1
