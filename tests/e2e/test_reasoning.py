"""``--reasoning-parser``: a model's ``<think>…</think>`` reasoning kept apart from its
answer in all three chat-shaped APIs, streamed and not (issue 27).

The model is written here: a tiny checkpoint whose chat template opens a ``<think>`` block
in its generation prompt (as DeepSeek-R1's and Qwen3's do), and whose weights make it
say one fixed reply. Every layer's output projections are zero, so the last hidden state
is the current token's embedding; the chain's tokens get one-hot embeddings and the
(untied) output head maps token i's direction to token i+1. Greedy or not, the served
model writes ``REASONING``, then ``</think>`` (three tokens in this vocabulary: the tag
arrives split), then ``ANSWER`` and end-of-turn, through the real engine and detokenizer.
"""

from __future__ import annotations

import itertools
import json
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from bundled_models import tiny
from tests.conftest import LaunchedServer

MODEL = "thinker"
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
REASONING = "Let me think it over."
ANSWER = "The answer is Paris."
REPLY = REASONING + "\n</think>\n\n" + ANSWER  # then <|im_end|>
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _write_thinker(out: Path) -> int:
    """The scripted checkpoint in ``out``; returns how many output tokens the reasoning
    block takes (through the token that completes ``</think>``)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    shutil.copytree(tiny.tiny_model_dir("qwen2"), out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    tok: Any = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    reply = [*tok.encode(REPLY, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    chain = [tok.encode(prompt, add_special_tokens=False)[-1], *reply]
    config = json.loads((out / "config.json").read_text())
    hidden = config["hidden_size"]
    assert len(set(chain)) == len(chain) <= hidden, "each chain token needs its own direction"
    assert "</think>" not in [tok.decode([t]) for t in reply]  # the closing tag is split
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()  # layers add nothing: the last hidden state is the token's embedding
        elif name.endswith("norm.weight"):
            w.fill_(1.0)
    embed = weights["model.embed_tokens.weight"]
    head = torch.zeros_like(embed)
    for i, (token, successor) in enumerate(itertools.pairwise(chain)):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(i), hidden).float()
        head[successor, i] = 10.0
    weights["lm_head.weight"] = head
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    return next(k for k in range(1, len(reply)) if "</think>" in tok.decode(reply[:k]))


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LaunchedServer, int]]:
    path = tmp_path_factory.mktemp("thinker") / "thinker"
    reasoning_tokens = _write_thinker(path)
    s = LaunchedServer(
        [
            "--model",
            str(path),
            "--served-model-name",
            MODEL,
            *shlex.split(
                "--prefill 1 --decode 1 --device cpu --kv-cache-tokens 4096 --max-model-len 512 --reasoning-parser qwen3"
            ),
        ]
    )
    s.wait_ready()
    yield s, reasoning_tokens
    s.stop()


@pytest.fixture(scope="module")
def chat(thinker: tuple[LaunchedServer, int]) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinker[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(thinker: tuple[LaunchedServer, int]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thinker[0].url, api_key="unused", max_retries=0)


def test_chat_completions_give_reasoning_content(
    chat: openai.OpenAI, thinker: tuple[LaunchedServer, int]
) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=64, temperature=0)
    whole = chat.chat.completions.create(**args)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING  # type: ignore[index]
    assert (message.content, whole.choices[0].finish_reason) == (ANSWER, "stop")
    details = whole.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.reasoning_tokens == thinker[1]
    reasoning = content = ""
    for chunk in chat.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_messages_give_a_thinking_block(claude: anthropic.Anthropic) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=64)
    whole = claude.messages.create(**args)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == REASONING  # type: ignore[union-attr]
    assert whole.content[1].text == ANSWER  # type: ignore[union-attr]
    assert whole.stop_reason == "end_turn"
    events = list(claude.messages.create(stream=True, **args))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert (thinking, text) == (REASONING, ANSWER)
    with claude.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]


def test_responses_give_a_reasoning_item(
    chat: openai.OpenAI, thinker: tuple[LaunchedServer, int]
) -> None:
    args: dict[str, Any] = dict(model=MODEL, input=ASK[0]["content"], max_output_tokens=64)
    whole = chat.responses.create(**args)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == REASONING  # type: ignore[union-attr,index]
    assert whole.output_text == ANSWER and whole.status == "completed"
    assert whole.usage is not None
    assert whole.usage.output_tokens_details.reasoning_tokens == thinker[1]
    events = list(chat.responses.create(stream=True, **args))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (REASONING, ANSWER)
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]


def test_stop_sequences_see_only_the_answer(claude: anthropic.Anthropic) -> None:
    # "over" is in the reasoning only: no stop. "Paris" is in the answer: a stop.
    message = claude.messages.create(
        model=MODEL, messages=ASK, max_tokens=64, stop_sequences=["over", "Paris"]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")
    assert message.content[0].thinking == REASONING  # type: ignore[union-attr]
    assert message.content[1].text == "The answer is "  # type: ignore[union-attr]


def test_a_forced_tool_call_skips_the_reasoning(claude: anthropic.Anthropic) -> None:
    """A grammar shapes the whole output, so the block the template opened is closed in the
    prompt: the call is the answer, and there is no reasoning to split."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = claude.messages.create(
        model=MODEL,
        messages=ASK,
        max_tokens=64,
        tools=[{"name": "capital", "input_schema": schema}],
        tool_choice={"type": "tool", "name": "capital"},
    )  # type: ignore[list-item]
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use"
    jsonschema.validate(use.input, schema)


def test_a_continued_reply_resumes_inside_its_reasoning(claude: anthropic.Anthropic) -> None:
    """A final assistant turn is continued (Anthropic's prefill); one that opened a block is
    continued as reasoning."""
    message = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[*ASK, {"role": "assistant", "content": "<think>\nLet me"}],
    )  # type: ignore[list-item]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "think it over."  # type: ignore[union-attr]
    assert message.content[1].text == ANSWER  # type: ignore[union-attr]
