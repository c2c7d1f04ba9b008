"""Logprobs with speculation at concurrency: several requests decoding side by side, of
contexts of different lengths, in the default bfloat16 (weights and KV cache).

Speculation on and off give the same tokens and logprobs within 1e-4, and so does one
request decoded alone against the same request in a batch: the CPU decode step computes
the attention of a request that reports logprobs over exactly its own context, as alone
(engine/model/attention.py), where its padding to a longer neighbour's width used to
move its logprobs by ~4e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from colocated.llm import GenerationResult
from tests.speculative.helpers import Oracle, engine, generate, prompts, with_proposer
from wire.params import SamplingParams

VOCAB = 151936
TOL = 1e-4
PROMPTS = prompts(6, 40)  # every third repeats itself: 60 tokens against 40
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    if i % 2 == 0
    else SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i, logprobs=2)
    for i in range(len(PROMPTS))
]


@pytest.fixture(scope="module")
def plain(default_model_path: Path) -> list[GenerationResult]:
    return generate(engine(default_model_path, None, dtype="bfloat16"), PROMPTS, PARAMS)


def _max_diff(got: list[GenerationResult], want: list[GenerationResult]) -> float:
    diffs = [0.0]
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        assert g.logprobs is not None and w.logprobs is not None
        assert g.top_logprobs is not None and w.top_logprobs is not None
        diffs += [abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)]
        for gt, wt in zip(g.top_logprobs, w.top_logprobs, strict=True):
            for (t, a), (u, b) in zip(gt, wt, strict=True):
                # NOTE: bfloat16 logits tie often; top-k may order a tie either way
                # (by the batch's layout), so a different id is a tie: the same value.
                assert t == u or a == b, (gt, wt)
                diffs.append(abs(a - b))
    return max(diffs)


@pytest.mark.parametrize(("mode", "k"), [("mixed", 4), ("accept", 2)])
def test_concurrent_streams_give_the_same_tokens_and_logprobs_with_speculation(
    default_model_path: Path, plain: list[GenerationResult], mode: str, k: int
) -> None:
    refs = {tuple(r.prompt_ids): r.output_ids for r in plain}
    llm = with_proposer(engine(default_model_path, k, dtype="bfloat16"), Oracle(refs, mode, VOCAB))
    got = generate(llm, PROMPTS, PARAMS)
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None and speculator.stats.num_accepted_tokens > 0
    assert _max_diff(got, plain) < TOL


def test_a_request_in_a_batch_reports_the_logprobs_it_reports_alone(
    default_model_path: Path, plain: list[GenerationResult]
) -> None:
    llm = engine(default_model_path, None, dtype="bfloat16")
    alone = [generate(llm, [p], [sp])[0] for p, sp in zip(PROMPTS[:4], PARAMS[:4], strict=True)]
    assert _max_diff(alone, plain[:4]) < TOL
