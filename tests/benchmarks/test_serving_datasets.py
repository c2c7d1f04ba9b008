"""Benchmark datasets: random prompts hit their token lengths; ShareGPT filtering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving import datasets as ds


def test_random_prompts_have_the_drawn_lengths(qwen_tokenizer: Any) -> None:
    reqs = ds.random_dataset(qwen_tokenizer, 20, input_len=64, output_len=16, ratio=0.5, seed=1)
    for r in reqs:
        assert 32 <= r.prompt_len <= 96 and 8 <= r.output_len <= 24
        assert r.prompt_len == len(qwen_tokenizer.encode(r.prompt, add_special_tokens=False))
    assert len({r.prompt for r in reqs}) == 20
    exact = ds.random_dataset(qwen_tokenizer, 10, input_len=50, output_len=5, ratio=0.0, seed=2)
    assert sum(r.prompt_len == 50 for r in exact) >= 8  # re-encoding rarely misses


def test_random_dataset_is_reproducible_by_seed(qwen_tokenizer: Any) -> None:
    a = ds.random_dataset(qwen_tokenizer, 3, 20, 4, 0.2, seed=7)
    assert a == ds.random_dataset(qwen_tokenizer, 3, 20, 4, 0.2, seed=7)
    assert a != ds.random_dataset(qwen_tokenizer, 3, 20, 4, 0.2, seed=8)


def test_mixed_alternates_prefill_and_decode_heavy(qwen_tokenizer: Any) -> None:
    reqs = ds.mixed_dataset(qwen_tokenizer, 4, input_len=80, output_len=64, seed=0)
    assert [r.output_len for r in reqs] == [8, 64, 8, 64]
    assert reqs[0].prompt_len > 4 * reqs[1].prompt_len


def test_sharegpt_uses_first_turns_and_filters(qwen_tokenizer: Any, tmp_path: Path) -> None:
    def conv(q: str, a: str) -> dict[str, Any]:
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}

    data = [
        conv("hi", "a long enough reply here"),
        {"conversations": []},
        conv("tell me a story about a fox please", "once upon a time there was a fox"),
        conv("what is two plus two, exactly?", "it is four, of course"),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = ds.sharegpt_dataset(qwen_tokenizer, path, 2, seed=0)
    assert {r.prompt for r in reqs} == {
        data[2]["conversations"][0]["value"],
        data[3]["conversations"][0]["value"],
    }
    with pytest.raises(ValueError, match="only 2 usable"):
        ds.sharegpt_dataset(qwen_tokenizer, path, 3, seed=0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_multiturn_turns_extend_their_history_and_wait_for_it(qwen_tokenizer: Any) -> None:
    reqs = ds.multiturn_dataset(
        qwen_tokenizer, 9, turns=3, prefix_len=40, input_len=10, output_len=12, seed=0
    )
    assert len(reqs) == 9 and [r.after for r in reqs] == [None] * 3 + list(range(6))
    system = reqs[0].messages[0] if reqs[0].messages else None
    for i, r in enumerate(reqs):
        assert r.messages is not None and r.messages[0] == system  # one shared system prompt
        assert r.messages[-1][0] == "user" and r.output_len == 12
        if r.after is None:
            continue
        prev = reqs[r.after]
        assert prev.messages is not None and r.messages[: len(prev.messages)] == prev.messages
        assert [role for role, _ in r.messages[len(prev.messages) :]] == ["assistant", "user"]
        # The plain-text prompt extends the previous turn's, and so do its tokens (all but
        # maybe the last token, which can merge across the boundary).
        assert r.prompt.startswith(prev.prompt), i
        ids, prev_ids = (qwen_tokenizer.encode(x.prompt) for x in (r, prev))
        assert _common_prefix(ids, prev_ids) >= len(prev_ids) - 1
    with pytest.raises(ValueError, match="at least one conversation"):
        ds.multiturn_dataset(qwen_tokenizer, 2, 3, 10, 10, 10, 0)


def test_shared_prefix_prompts_share_the_prefix_and_differ_after_it(qwen_tokenizer: Any) -> None:
    reqs = ds.shared_prefix_dataset(
        qwen_tokenizer, 4, prefix_len=64, input_len=16, output_len=5, seed=3
    )
    ids = [qwen_tokenizer.encode(r.prompt) for r in reqs]
    assert len({r.prompt for r in reqs}) == 4
    for other in ids[1:]:
        assert 63 <= _common_prefix(ids[0], other) < len(other)
    assert all(isinstance(r, ds.SampleRequest) and 75 <= r.prompt_len <= 85 for r in reqs)
