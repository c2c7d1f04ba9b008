"""What `make run` serves: SmolLM2-135M-Instruct on CPU, 2P/2D/2K with default flags.

It answers a question a person can judge, its greedy outputs equal transformers' on the
same weights, and no worker dies on the way (the memory budget holds).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
import torch
from openai import OpenAI

from checkpoints.default_model import default_model_dir
from tests.conftest import LaunchedServer

pytestmark = pytest.mark.slow
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smol() -> Iterator[LaunchedServer]:
    srv = LaunchedServer(["--prefill", "2", "--decode", "2", "--detokenizers", "2",
                          "--device", "cpu"], tiny_model=False)  # fmt: skip
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(smol: LaunchedServer) -> OpenAI:
    return OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_default_model_names_the_capital_of_france(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0,
    )  # fmt: skip
    assert "Paris" in (out.choices[0].message.content or "")


def test_greedy_outputs_equal_transformers_through_2p2d(
    smol: LaunchedServer, client: OpenAI
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    tok: Any = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    questions = ["Name three colours.", "What is 2 + 2?", "Write a haiku about the sea.",
                 "Who wrote Hamlet?"]  # fmt: skip
    for q in questions:
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)  # as the server tokenizes it
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        want = ref[0, len(ids) :].tolist()
        got = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=32, temperature=0,  # type: ignore[arg-type]
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        ids_out = got.choices[0].model_extra["token_ids"]  # type: ignore[index]
        n = len(ids_out)
        assert ids_out == want[:n] and (n == len(want) or want[n - 1] in tok.all_special_ids), q
    # No worker died: every process is the one that became ready.
    assert not [line for line in smol.log if "restarting in" in line or "exited" in line]
    assert all(w["alive"] for w in smol.health()["workers"])


def test_an_anthropic_client_gets_the_answer(smol: LaunchedServer) -> None:
    """/v1/messages through the official SDK: the answer, streamed as it is whole."""
    claude = anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0, timeout=120)
    args: dict[str, Any] = dict(
        model=NAME, max_tokens=24, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )  # fmt: skip
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
    args: dict[str, Any] = dict(model=NAME, input="What is the capital of France?",
                                max_output_tokens=24, temperature=0)  # fmt: skip
    whole = client.responses.create(**args)
    assert "Paris" in whole.output_text and whole.status in ("completed", "incomplete")
    events = list(client.responses.create(stream=True, **args))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
