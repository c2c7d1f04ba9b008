"""Proposers: the n-gram index, the draft model's exactness, the config flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from bundled_models import tiny
from engine.config import SpeculativeConfig, parse_speculative_config
from engine.kv.sequence import Sequence
from engine.speculative.ngram import NgramProposer
from tests.speculative.helpers import engine, prompts, ungated
from wire.params import SamplingParams


def _seq(prompt: list[int], output: list[int] | None = None, rid: int = 1) -> Sequence:
    return Sequence(rid=rid, prompt_ids=prompt, output_ids=output or [])


def test_ngram_proposes_what_followed_the_longest_matching_suffix() -> None:
    p = NgramProposer(2, 3)
    # "5 6" occurred twice: after "4 5 6" (a 3-gram match) came 9; after "1 5 6", 7.
    seq = _seq([1, 5, 6, 7, 8, 4, 5, 6, 9, 2, 4, 5, 6])
    assert p.propose([seq], [3]) == [[9, 2, 4]]
    assert p.propose([seq], [1]) == [[9]]
    # No earlier occurrence of the suffix "6 3" (and not itself): nothing.
    seq.output_ids.append(3)
    assert p.propose([seq], [3]) == [[]]


def test_ngram_index_grows_with_the_output_and_never_matches_itself() -> None:
    p = NgramProposer(1, 2)
    seq = _seq([10, 11, 12])
    assert p.propose([seq], [4]) == [[]]  # "12" has not occurred before
    seq.output_ids += [10, 11]  # now "10 11" repeats: 12 followed it
    assert p.propose([seq], [4]) == [[12, 10, 11]]  # runs to the end of what is known
    # Catching up indexes only what was appended (a dict update per token).
    idx = p._index[seq.rid]
    assert idx.tokens == [10, 11, 12, 10, 11]
    assert idx.by_size[1] == {(10, 11): 2, (11, 12): 3, (12, 10): 4}  # not (10, 11) -> 5
    p.release(seq.rid)
    assert seq.rid not in p._index


def test_ngram_keeps_requests_apart() -> None:
    p = NgramProposer(1, 1)
    a, b = _seq([1, 2, 1], rid=1), _seq([1, 3, 1], rid=2)
    assert p.propose([a, b], [2, 2]) == [[2, 1], [3, 1]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "eagle"}', "method must be one of"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
        ('{"num_speculative_tokens": "4"}', "must be a int"),
        ('{"num_spec_tokens": 4}', "unknown field 'num_spec_tokens'"),
        ('{"method": "draft_model"}', "model"),
        ("[4]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_speculative_config_says_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)


def test_vllm_style_config_parses() -> None:
    text = (
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}'
    )
    assert parse_speculative_config(text) == SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=5
    )


@pytest.mark.parametrize("draft_arch", ["qwen2", "llama"])
def test_a_draft_model_changes_nothing_but_speed(default_model_path: Path, draft_arch: str) -> None:
    """Target tiny-qwen2; drafts from tiny-llama (another model: mostly rejected) or from
    tiny-qwen2 itself (the target's own greedy picks: accepted)."""
    ps = prompts(6, 20)
    params = [
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.9, seed=4, logprobs=1),
    ] * 3
    want = engine(default_model_path, None).generate(ps, params)
    draft = str(tiny.tiny_model_dir(draft_arch))
    config = SpeculativeConfig(
        method="draft_model", model=draft, num_speculative_tokens=4, disable_by_batch_size=64
    )
    llm = ungated(engine(default_model_path, 4, speculative=config))
    got = llm.generate(ps, params)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    stats = llm.scheduler.decode.speculator.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0
    if draft_arch == "qwen2":  # greedy requests: the draft is the target (4 of 5 tokens)
        greedy_decoded = sum(len(w.output_ids) - 1 for w in want[::2])
        assert stats.num_accepted_tokens >= 0.6 * greedy_decoded
