"""Per-request drafted/accepted counts: what the token rows say, against the engine's own.

A request's counts come from its token rows (``TokenBatch.drafted``/``accepted``): the
drafts each step verified, and which emitted tokens were accepted drafts. With forced
drafts (``Oracle``) the numbers are known exactly: with every draft right and k = 4,
each decode step emits four accepted drafts and one sampled token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from colocated.llm import GenerationResult
from tests.speculative.helpers import Oracle, engine, generate, prompts, with_proposer
from wire.params import SamplingParams
from wire.records import Finish

VOCAB = 151936
K = 4
PROMPTS = prompts(4)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> list[GenerationResult]:
    return generate(engine(default_model_path, None), PROMPTS, LONG)


def _oracle(reference: list[GenerationResult], mode: str) -> Oracle:
    return Oracle({tuple(r.prompt_ids): r.output_ids for r in reference}, mode, VOCAB)


def _all_right(n: int, max_tokens: int = 24) -> tuple[int, int]:
    """(drafted, accepted) of a request whose every draft is right and whose output ends
    after ``n`` tokens: the first token is prefill's; each step verifies up to K drafts
    (no draft past max_tokens) and emits them and the token sampled after them."""
    drafted = accepted = 0
    pos = 1  # output positions emitted so far
    while pos < n:
        k = max(0, min(K, max_tokens - pos - 1))
        drafted += k
        accepted += min(k, n - pos)  # the step's run, cut where the output ends
        pos += k + 1
    return drafted, accepted


def test_counts_without_speculation_are_zero(reference: list[GenerationResult]) -> None:
    assert all((r.drafted_tokens, r.accepted_tokens) == (0, 0) for r in reference)


@pytest.mark.parametrize("mode", ["accept", "reject", "mixed"])
def test_a_single_requests_counts_agree_with_the_engines(
    default_model_path: Path, reference: list[GenerationResult], mode: str
) -> None:
    llm = with_proposer(engine(default_model_path, K), _oracle(reference, mode))
    [got] = generate(llm, PROMPTS[:1], LONG)
    assert got.output_ids == reference[0].output_ids
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None
    st = speculator.stats
    assert got.drafted_tokens == st.num_draft_tokens > 0
    assert got.accepted_tokens == st.num_accepted_tokens
    if mode == "accept":
        assert (got.drafted_tokens, got.accepted_tokens) == _all_right(len(got.output_ids))
    if mode == "reject":
        assert got.accepted_tokens == 0


def test_counts_of_a_batch_add_up_to_the_engines(
    default_model_path: Path, reference: list[GenerationResult]
) -> None:
    llm = with_proposer(engine(default_model_path, K), _oracle(reference, "mixed"))
    got = generate(llm, PROMPTS, LONG)
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None
    assert sum(r.drafted_tokens for r in got) == speculator.stats.num_draft_tokens
    assert sum(r.accepted_tokens for r in got) == speculator.stats.num_accepted_tokens
    for r in got:  # a draft accepted is an output token; at most half of k per step here
        assert 0 < r.accepted_tokens < len(r.output_ids) and r.accepted_tokens < r.drafted_tokens


@pytest.mark.parametrize("where", [1, 3, 5, 7, 10])  # step offsets 0, 2, bonus (4), 1, 4
def test_a_stop_token_inside_an_accepted_run_counts_only_what_was_emitted(
    default_model_path: Path, reference: list[GenerationResult], where: int
) -> None:
    """The engine verified the whole run, but the request ends at the stop: drafts past
    it are drafted, not accepted (they are not in the output)."""
    ref = reference[0].output_ids
    stop = ref[where]
    first = ref.index(stop)  # the output without speculation stops at the first one
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    llm = with_proposer(engine(default_model_path, K), _oracle(reference, "accept"))
    [got] = generate(llm, PROMPTS[:1], params)
    assert got.output_ids == ref[: first + 1] and got.finish == Finish.STOP
    speculator = llm.scheduler.decode.speculator
    assert speculator is not None
    assert (got.drafted_tokens, got.accepted_tokens) == _all_right(first + 1)
    assert got.drafted_tokens == speculator.stats.num_draft_tokens
    assert speculator.stats.num_accepted_tokens >= got.accepted_tokens
    if first >= 1 and (first - 1) % (K + 1) < K - 1:  # the run went on past the stop
        assert speculator.stats.num_accepted_tokens > got.accepted_tokens
