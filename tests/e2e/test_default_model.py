"""What `make run` serves: SmolLM2-135M-Instruct on CPU, 2P/2D/2K with default flags.

It answers a question a person can judge; its greedy outputs equal the in-process engine's
on the same packed weights, and served in float32 (--quantization none) transformers'; no
worker dies on the way (the memory budget holds).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
import torch
from openai import OpenAI

from bundled_models.default_model import default_model_dir
from colocated.llm import LLM
from engine.config import EngineConfig
from tests.conftest import LaunchedServer
from wire.params import SamplingParams

pytestmark = pytest.mark.slow
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smol() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        "--prefill 2 --decode 2 --detokenizers 2 --device cpu",
        tiny_model=False,
    )


@pytest.fixture(scope="module")
def client(smol: LaunchedServer) -> OpenAI:
    return OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_default_model_names_the_capital_of_france(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in (out.choices[0].message.content or "")


QUESTIONS = [
    "Name three colours.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
]


def _served_greedy(client: OpenAI, messages: list[dict[str, str]]) -> list[int]:
    got = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=32,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )
    return got.choices[0].model_extra["token_ids"]  # type: ignore[index, no-any-return]


def _prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)  # type: ignore[no-any-return]


def test_the_packed_default_serves_what_the_engine_computes_in_process(
    smol: LaunchedServer, client: OpenAI
) -> None:
    """The default serves the GGUF's Q4_1 blocks packed; through 2P/2D it gives the greedy
    tokens one in-process engine computes on the same packed weights.

    Each question opens with its own system line, so no prompt reuses another's cached
    prefix: the packed layers compute in bfloat16, whose rounding depends on how a prompt
    was split (a prefix-cache hit on one prefill worker and not on another), and two runs
    of differently split prompts may part after a near tie many tokens in. Served
    float32 is exact whatever the split (the next test).
    """
    from transformers import AutoTokenizer

    path = default_model_dir()
    tok: Any = AutoTokenizer.from_pretrained(path)
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=64, large_batch_gemm=True))
    assert llm.runner.quantization == "gguf"
    for i, q in enumerate(QUESTIONS):
        messages = [
            {"role": "system", "content": f"Question {i + 1}: answer briefly."},
            {"role": "user", "content": q},
        ]
        ids = _prompt_ids(tok, messages)
        [want] = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32))
        assert _served_greedy(client, messages) == want.output_ids, q
    # No worker died: every process is the one that became ready.
    assert not [line for line in smol.log if "restarting in" in line or "exited" in line]
    assert all(w["alive"] for w in smol.health()["workers"])


def test_float32_serving_equals_transformers_through_1p1d() -> None:
    """--quantization none: the float32 weights de-quantized from the GGUF, exact."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv = LaunchedServer(
        shlex.split("--prefill 1 --decode 1 --device cpu --quantization none"),
        tiny_model=False,
    )
    srv.wait_ready()
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        path = default_model_dir()
        tok: Any = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for q in QUESTIONS:
            messages = [{"role": "user", "content": q}]
            ids = _prompt_ids(tok, messages)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
            want = ref[0, len(ids) :].tolist()
            got = _served_greedy(client, messages)
            n = len(got)
            assert got == want[:n] and (n == len(want) or want[n - 1] in tok.all_special_ids), q
    finally:
        srv.stop()


def test_an_anthropic_client_gets_the_answer(smol: LaunchedServer) -> None:
    """/v1/messages through the official SDK: the answer, streamed as it is whole."""
    claude = anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0, timeout=120)
    args: dict[str, Any] = dict(
        model=NAME,
        max_tokens=24,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    whole = claude.messages.create(**args)
    (block,) = whole.content
    assert block.type == "text" and "Paris" in block.text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=NAME, messages=args["messages"])
    prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert prompt == counted.input_tokens
    events = list(claude.messages.create(stream=True, **args))
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == block.text and events[-2].delta.stop_reason == whole.stop_reason


def test_a_responses_client_gets_the_answer(client: OpenAI) -> None:
    """/v1/responses through the official SDK: the answer, streamed as it is whole."""
    args: dict[str, Any] = dict(
        model=NAME, input="What is the capital of France?", max_output_tokens=24, temperature=0
    )
    whole = client.responses.create(**args)
    assert "Paris" in whole.output_text and whole.status in ("completed", "incomplete")
    events = list(client.responses.create(stream=True, **args))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
