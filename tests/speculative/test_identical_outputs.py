"""Speculation on equals speculation off: token ids, logprobs, finish, for every draft mix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from colocated.llm import GenerationResult
from tests.speculative.helpers import Oracle, engine, generate, prompts, with_proposer
from wire.params import SamplingParams
from wire.records import Finish

VOCAB = 151936
PROMPTS = prompts()
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
SAMPLED = [
    SamplingParams(max_tokens=16, temperature=0.8, seed=11, logprobs=1),
    SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=12),
    SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=13),
    SamplingParams(max_tokens=16, temperature=1.2, top_k=50, top_p=0.8, min_p=0.01, seed=14),
]
PENALISED = [
    SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3),
    SamplingParams(
        max_tokens=16, temperature=0.9, seed=3, presence_penalty=1.5, frequency_penalty=0.7
    ),
]


def _params(n: int) -> list[SamplingParams]:
    mixed = [GREEDY, *SAMPLED, *PENALISED]
    return [mixed[i % len(mixed)] for i in range(n)]


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> list[GenerationResult]:
    return generate(engine(default_model_path, None), PROMPTS, _params(len(PROMPTS)))


def _refs(results: list[GenerationResult]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(r.prompt_ids): r.output_ids for r in results}


def assert_same(got: list[GenerationResult], want: list[GenerationResult]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        assert g.finish == w.finish
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None and g.logprobs is not None:
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4
            assert g.top_logprobs is not None and w.top_logprobs is not None
            for gt, wt in zip(g.top_logprobs, w.top_logprobs, strict=True):
                assert [t for t, _ in gt] == [t for t, _ in wt]
                assert max((abs(a - b) for (_, a), (_, b) in zip(gt, wt)), default=0) < 1e-4


@pytest.mark.parametrize(
    ("mode", "k"), [("accept", 1), ("accept", 8), ("reject", 4), ("mixed", 8), ("mixed", 3)]
)
def test_outputs_are_identical_whatever_the_drafts(
    default_model_path: Path, reference: list[GenerationResult], mode: str, k: int
) -> None:
    """Greedy, seeded temperature / top-p / top-k / min-p, and penalties, batched."""
    oracle = Oracle(_refs(reference), mode, VOCAB)
    llm = with_proposer(engine(default_model_path, k), oracle)
    got = generate(llm, PROMPTS, _params(len(PROMPTS)))
    assert_same(got, reference)
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None and oracle.proposed > 0
    st = speculator.stats
    assert st.num_draft_tokens > 0
    if mode == "accept":  # k of every k + 1 decode tokens at least, but near max_tokens
        decoded = sum(len(r.output_ids) - 1 for r in reference)
        assert st.num_accepted_tokens >= 0.7 * k / (k + 1) * decoded
    if mode == "reject":
        assert st.num_accepted_tokens == 0
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    llm.runner.kv.allocator.check_invariants()
    assert llm.runner.kv.allocator.num_used == 0


def test_one_request_alone_gets_several_tokens_a_step(
    default_model_path: Path, reference: list[GenerationResult]
) -> None:
    llm = with_proposer(engine(default_model_path, 4), Oracle(_refs(reference), "accept", VOCAB))
    got = llm.generate([PROMPTS[0]], GREEDY)
    assert got[0].output_ids == reference[0].output_ids
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None
    # 15 decode tokens, 5 a step (4 drafts + the bonus): 3 verify steps.
    assert speculator.stats.num_drafts == 3 and speculator.stats.num_accepted_tokens == 4 + 4 + 4


@pytest.mark.parametrize("cut", [1, 3, 5])  # a run's first draft, a middle one, the bonus
@pytest.mark.parametrize("how", ["stop_token", "eos", "max_tokens"])
def test_a_stop_inside_an_accepted_run_cuts_it_there(
    default_model_path: Path, reference: list[GenerationResult], cut: int, how: str
) -> None:
    """With k = 4 all accepted, the first decode step emits output positions 1-5: 1-4
    were drafts, 5 the bonus token. A stop at ``cut`` must end the output exactly there."""
    ref = reference[0].output_ids
    token = ref[cut]
    assert token not in ref[:cut]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    if how == "stop_token":
        params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, stop_token_ids=(token,))
    elif how == "max_tokens":
        params = SamplingParams(max_tokens=cut + 1, temperature=0.0, logprobs=2)
    results = []
    for k in (None, 4):
        llm = engine(default_model_path, k)
        if k is not None:
            with_proposer(llm, Oracle(_refs(reference), "accept", VOCAB))
        if how == "eos":
            stops = replace(llm.engine.stops, eos_token_ids=(token,))
            llm.scheduler.prefill.stops = llm.scheduler.decode.stops = stops
        results.append(generate(llm, [PROMPTS[0]], params))
        llm.runner.kv.allocator.check_invariants()
        assert llm.runner.kv.allocator.num_used == 0
    assert_same(results[1], results[0])
    got = results[1][0]
    assert got.output_ids == ref[: cut + 1]
    assert got.logprobs is not None and len(got.logprobs) == cut + 1
    assert got.finish == (Finish.LENGTH if how == "max_tokens" else Finish.STOP)


def test_logprobs_match_with_a_bfloat16_kv_cache(default_model_path: Path) -> None:
    """Quantized weights keep K and V in bfloat16 (engine/weights/plan.py), the serving
    default. Verification rows attend as decode rows do (in the cache's dtype) and the
    refined LM head leaves each row's logits independent of the rows beside it, so one
    request's logprobs and top_logprobs equal speculation off (they were ~1e-3 apart).

    NOTE: one request at a time: with a bfloat16 cache, decode itself is not invariant
    to the batch beside a request (its attention runs over the batch's padded width, and
    the CPU kernel's reduction order depends on that width: up to ~2e-3 in logprob), so
    batched runs of different step compositions compare decode with decode's own noise.
    """
    params = [GREEDY, SAMPLED[0]] * 3
    ref_llm = engine(default_model_path, None, quantization="int8")
    assert ref_llm.runner.kv_dtype == torch.bfloat16
    reference = [generate(ref_llm, [p], q)[0] for p, q in zip(PROMPTS[:6], params)]
    for mode in ("mixed", "accept"):
        oracle = Oracle(_refs(reference), mode, VOCAB)
        llm = with_proposer(engine(default_model_path, 4, quantization="int8"), oracle)
        got = [generate(llm, [p], q)[0] for p, q in zip(PROMPTS[:6], params)]
        assert_same(got, reference)
        assert oracle.proposed > 0
