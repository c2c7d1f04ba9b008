"""The official ``openai`` SDK against the launched disaggregated server (issue 7).

Every test talks to the shared ``server`` fixture (2 prefill, 2 decode, 2 detokenizer
processes on CPU): what the SDK parses here is what a real client would get.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import LaunchedServer

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def sdk(server: LaunchedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI) -> str:
    (card,) = sdk.models.list().data
    return card.id


def _extra(**fields: Any) -> dict[str, Any]:
    return {"extra_body": {"ignore_eos": True, **fields}}


def test_greedy_completion_equals_transformers_generate(
    sdk: openai.OpenAI, model: str, default_model_path: Path, qwen_tokenizer: Any
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    c = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, **_extra(return_token_ids=True)
    )
    choice = c.model_dump()["choices"][0]
    ids = qwen_tokenizer.encode(prompt)
    assert choice["prompt_token_ids"] == ids
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    want = hf.generate(  # type: ignore[misc]  # transformers' stubs mistype generate
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    assert choice["token_ids"] == want[0, len(ids) :].tolist()
    assert choice["text"] == qwen_tokenizer.decode(choice["token_ids"], skip_special_tokens=True)


def test_completion_streamed_equals_non_streamed_with_usage(sdk: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(model=model, prompt="Once upon a time", max_tokens=10, **GREEDY)
    whole = sdk.completions.create(**args)
    assert whole.usage is not None
    assert (whole.usage.completion_tokens, whole.choices[0].finish_reason) == (10, "length")
    chunks = list(
        sdk.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_streamed_equals_non_streamed_with_usage(sdk: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(model=model, messages=CHAT, max_tokens=10, **GREEDY)
    whole = sdk.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant" and whole.usage is not None
    assert whole.usage.completion_tokens == 10
    chunks = list(
        sdk.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    without = list(sdk.chat.completions.create(**args, stream=True))
    assert all(ch.usage is None for ch in without)


def test_completion_logprobs(sdk: openai.OpenAI, model: str) -> None:
    c = sdk.completions.create(model=model, prompt="Hello", max_tokens=6, logprobs=3, **GREEDY)
    choice = c.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob < 0 and token in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy takes the argmax


def test_chat_logprobs_with_top_logprobs(sdk: openai.OpenAI, model: str) -> None:
    c = sdk.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    choice = c.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob < 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.bytes == list(t.token.encode())


def _stop_case(sdk: openai.OpenAI, model: str) -> tuple[dict[str, Any], str, str]:
    args: dict[str, Any] = dict(model=model, prompt="Once upon a time", max_tokens=16, **GREEDY)
    full = sdk.completions.create(**args).choices[0].text
    stop = full[6:9]
    assert stop.strip(), f"need a visible stop string inside {full!r}"
    return args, full, stop


def test_stop_string_is_never_returned(sdk: openai.OpenAI, model: str) -> None:
    args, full, stop = _stop_case(sdk, model)
    choice = sdk.completions.create(**args, stop=[stop, "never-seen-stop"]).choices[0]
    assert choice.text == full[: full.index(stop)] and stop not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_dump()["stop_reason"] == stop
    chunks = list(sdk.completions.create(**args, stop=stop, stream=True))
    streamed = "".join(ch.choices[0].text for ch in chunks)
    assert streamed == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_dump()["stop_reason"] == stop


def test_chat_stop_string(sdk: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(model=model, messages=CHAT, max_tokens=16, **GREEDY)
    full = sdk.chat.completions.create(**args).choices[0].message.content
    assert full is not None
    stop = full[6:9]
    assert stop.strip(), f"need a visible stop string inside {full!r}"
    choice = sdk.chat.completions.create(**args, stop=stop).choices[0]
    assert choice.message.content == full[: full.index(stop)]
    assert (choice.finish_reason, choice.model_dump()["stop_reason"]) == ("stop", stop)


def _seeded(model: str, seed: int) -> dict[str, Any]:
    return dict(model=model, prompt="Random words:", max_tokens=12, temperature=1.0, seed=seed)


async def _seeded_under_load(url: str, model: str) -> tuple[list[str], list[str]]:
    """Two runs each of two seeds, interleaved with unseeded requests of other shapes."""
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as sdk:

        async def text(**args: Any) -> str:
            c = await sdk.completions.create(**args, extra_body={"ignore_eos": True})
            return c.choices[0].text

        noise = [
            text(model=model, prompt="x " * (1 + 9 * i), max_tokens=4 + i, temperature=1.0)
            for i in range(6)
        ]
        seeded = [text(**_seeded(model, s)) for s in (7, 7, 8, 8)]
        results = await asyncio.gather(*seeded[:2], *noise, *seeded[2:])
        return [results[0], results[1]], [results[-2], results[-1]]


def test_seed_reproduces_sampled_text_also_under_concurrency(
    sdk: openai.OpenAI, model: str, server: LaunchedServer
) -> None:
    alone = [
        sdk.completions.create(**_seeded(model, 7), extra_body={"ignore_eos": True}).choices[0].text
        for _ in range(2)
    ]
    assert alone[0] == alone[1]
    sevens, eights = asyncio.run(_seeded_under_load(server.url + "/v1", model))
    assert sevens == alone
    assert eights[0] == eights[1] and eights[0] != sevens[0]


def test_return_token_ids_in_completion_and_chat(
    sdk: openai.OpenAI, model: str, qwen_tokenizer: Any
) -> None:
    c = sdk.completions.create(
        model=model,
        prompt="Hi there",
        max_tokens=5,
        **GREEDY,
    ).model_dump()["choices"][0]
    assert "token_ids" not in c  # only on request
    c = sdk.completions.create(
        model=model, prompt="Hi there", max_tokens=5, temperature=0, **_extra(return_token_ids=True)
    ).model_dump()["choices"][0]
    assert c["prompt_token_ids"] == qwen_tokenizer.encode("Hi there")
    assert len(c["token_ids"]) == 5
    assert c["text"] == qwen_tokenizer.decode(c["token_ids"], skip_special_tokens=True)
    chat = sdk.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0, **_extra(return_token_ids=True)
    ).model_dump()
    prompt = qwen_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["prompt_token_ids"] == qwen_tokenizer.encode(prompt, add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    assert len(chat["choices"][0]["token_ids"]) == 5
    stream = sdk.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [ch.model_dump() for ch in stream]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    streamed_ids = [t for ch in chunks for t in ch["choices"][0].get("token_ids") or []]
    assert streamed_ids == chat["choices"][0]["token_ids"]


def test_sdk_raises_typed_errors(sdk: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="'logit_bias' is not supported"):
        sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=1, logit_bias={"5": 1})
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        sdk.completions.create(model=model, prompt=[1] * 1000, max_tokens=100)
