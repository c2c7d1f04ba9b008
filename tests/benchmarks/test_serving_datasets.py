"""Benchmark datasets: random prompts hit their token lengths; ShareGPT filtering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving.datasets import mixed_dataset, random_dataset, sharegpt_dataset


def test_random_prompts_have_the_drawn_lengths(qwen_tokenizer: Any) -> None:
    reqs = random_dataset(qwen_tokenizer, 20, input_len=64, output_len=16, ratio=0.5, seed=1)
    for r in reqs:
        assert 32 <= r.prompt_len <= 96 and 8 <= r.output_len <= 24
        assert r.prompt_len == len(qwen_tokenizer.encode(r.prompt, add_special_tokens=False))
    assert len({r.prompt for r in reqs}) == 20
    exact = random_dataset(qwen_tokenizer, 10, input_len=50, output_len=5, ratio=0.0, seed=2)
    assert sum(r.prompt_len == 50 for r in exact) >= 8  # re-encoding rarely misses


def test_random_dataset_is_reproducible_by_seed(qwen_tokenizer: Any) -> None:
    a = random_dataset(qwen_tokenizer, 3, 20, 4, 0.2, seed=7)
    assert a == random_dataset(qwen_tokenizer, 3, 20, 4, 0.2, seed=7)
    assert a != random_dataset(qwen_tokenizer, 3, 20, 4, 0.2, seed=8)


def test_mixed_alternates_prefill_and_decode_heavy(qwen_tokenizer: Any) -> None:
    reqs = mixed_dataset(qwen_tokenizer, 4, input_len=80, output_len=64, seed=0)
    assert [r.output_len for r in reqs] == [8, 64, 8, 64]
    assert reqs[0].prompt_len > 4 * reqs[1].prompt_len


def test_sharegpt_uses_first_turns_and_filters(qwen_tokenizer: Any, tmp_path: Path) -> None:
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q},  # noqa: E731
                                           {"from": "gpt", "value": a}]}  # fmt: skip
    data = [conv("hi", "a long enough reply here"), {"conversations": []},
            conv("tell me a story about a fox please", "once upon a time there was a fox"),
            conv("what is two plus two, exactly?", "it is four, of course")]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_dataset(qwen_tokenizer, path, 2, seed=0)
    assert {r.prompt for r in reqs} == {data[2]["conversations"][0]["value"],
                                        data[3]["conversations"][0]["value"]}  # fmt: skip
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_dataset(qwen_tokenizer, path, 3, seed=0)
