"""Speculation on a GPU: the decode step runs the Triton kernel path (decode CUDA graphs),
verification the torch path over the same pool. In float32 outputs equal speculation off
token for token, whatever the drafts, and logprobs within 1e-4.

bfloat16 is not here: there a verification's logits sit a few roundings from the decode
step's (up to 0.012 on an H200 with this model, ``python -m benchmarks.engine.speculation_rounding
--device cuda``), so a near-tie can break the other way: speculation keeps the
distribution, not the bits (docs/speculative.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colocated.llm import GenerationResult
from tests.speculative.helpers import Oracle, engine, generate, prompts, with_proposer
from wire.params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

VOCAB = 151936
PROMPTS = prompts(12)
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0.8, seed=11),
    SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=13),
]


def _params() -> list[SamplingParams]:
    return [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize(("mode", "k"), [("accept", 4), ("reject", 4), ("mixed", 8)])
def test_cuda_outputs_are_identical_whatever_the_drafts(
    default_model_path: Path, mode: str, k: int
) -> None:
    off = engine(default_model_path, None, device="cuda", dtype="float32")
    want: list[GenerationResult] = generate(off, PROMPTS, _params())
    refs = {tuple(r.prompt_ids): r.output_ids for r in want}
    oracle = Oracle(refs, mode, VOCAB)
    on = with_proposer(engine(default_model_path, k, device="cuda", dtype="float32"), oracle)
    got = generate(on, PROMPTS, _params())
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.output_ids == w.output_ids, i
        assert g.finish == w.finish
        if w.logprobs is not None:
            assert g.logprobs is not None
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4
    speculator = on.scheduler.decode.speculator
    assert speculator is not None and speculator.stats.num_draft_tokens > 0
    if mode == "reject":
        assert speculator.stats.num_accepted_tokens == 0
    else:
        assert speculator.stats.num_accepted_tokens > 0
    on.runner.kv.allocator.check_invariants()
    assert on.runner.kv.allocator.num_used == 0
