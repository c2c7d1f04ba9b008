"""Anthropic's Messages API on a launched 2P/2D server, driven by the official ``anthropic``
SDK (issue 27): text streamed and not, tools, stop sequences, usage, disconnects, errors.

The tiny model's weights are random: its text is gibberish, so the tests compare outputs
with each other (greedy streamed against greedy whole), with the tokenizer, and with what
the engine reports; a tool call that validates comes from the grammar a forced
``tool_choice`` puts on the output.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.conftest import AGENT_MODEL as MODEL
from tests.e2e.conftest import TOOLS_TEMPLATE
from tests.e2e.helpers import (
    WEATHER_SCHEMA,
    computed_prefill_tokens,
    greedy_chat_ids,
    leave_mid_stream,
    render_ids,
)

GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": WEATHER_SCHEMA,
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


def as_chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: v for k, v in tool.items() if k in ("name", "description")}
    return {"type": "function", "function": {**fn, "parameters": tool["input_schema"]}}


@pytest.fixture(scope="module")
def claude(agent_server: LaunchedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=agent_server.url, api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def template() -> str:
    return TOOLS_TEMPLATE.read_text()


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_streamed_text_joined_equals_the_whole_message(claude: anthropic.Anthropic) -> None:
    args: dict[str, Any] = dict(model=MODEL, max_tokens=12, messages=ASK, **GREEDY)
    whole = claude.messages.create(**args)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert [b.type for b in whole.content] == ["text"]
    assert (whole.stop_reason, whole.stop_sequence, whole.usage.output_tokens) == (
        "max_tokens",
        None,
        12,
    )
    events = list(claude.messages.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == whole.content[0].text
    end = events[-2]
    assert (end.delta.stop_reason, end.usage.output_tokens) == ("max_tokens", 12)
    with claude.messages.stream(**args) as stream:  # the SDK's own accumulation agrees
        assert text_of(stream.get_final_message()) == whole.content[0].text


def test_usage_counts_the_tokens_processed(
    claude: anthropic.Anthropic,
    agent_server: LaunchedServer,
    qwen_tokenizer: Any,
    template: str,
) -> None:
    messages = [{"role": "user", "content": "A prompt no other test sends: " + "usage " * 30}]
    system = "You count tokens."
    prompt = render_ids(
        qwen_tokenizer, template, [{"role": "system", "content": system}, *messages]
    )
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert counted.input_tokens == len(prompt)
    args: dict[str, Any] = dict(
        model=MODEL, system=system, messages=messages, max_tokens=7, **GREEDY
    )
    before = computed_prefill_tokens(agent_server)
    first = claude.messages.create(**args)
    # A new prompt: every token computed by a prefill worker, none from the cache.
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens) == (len(prompt), 0)
    assert computed_prefill_tokens(agent_server) - before == len(prompt)
    # The output tokens are the ids the engine generated: the same greedy request through
    # chat completions lists them.
    conversation = [{"role": "system", "content": system}, *messages]
    ids = greedy_chat_ids(agent_server, MODEL, conversation, 7)
    assert first.usage.output_tokens == len(ids) == 7
    # Again: the prefix cache supplies what it holds, and only the rest is computed.
    before = computed_prefill_tokens(agent_server)
    again = claude.messages.create(**args)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(prompt)
    assert computed_prefill_tokens(agent_server) - before == again.usage.input_tokens


def test_count_tokens_renders_tools_and_history(
    claude: anthropic.Anthropic, qwen_tokenizer: Any, template: str
) -> None:
    history: list[dict[str, Any]] = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    chat_history = [
        *ASK,
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "celsius"},
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 degrees"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    want = render_ids(qwen_tokenizer, template, chat_history, [as_chat_tool(WEATHER)])
    got = claude.messages.count_tokens(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],
    )  # type: ignore[list-item]
    assert got.input_tokens == len(want)


def test_a_final_assistant_turn_is_continued(
    claude: anthropic.Anthropic, qwen_tokenizer: Any, template: str
) -> None:
    """Anthropic's prefill: the prompt ends inside the assistant's turn, after its text."""
    messages: list[Any] = [*ASK, {"role": "assistant", "content": "The weather is"}]
    text = qwen_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, continue_final_message=True
    )
    assert text.endswith("The weather is")
    want = len(qwen_tokenizer.encode(text, add_special_tokens=False))
    assert claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens == want
    reply = claude.messages.create(model=MODEL, max_tokens=4, messages=messages)
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == want


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_validates_and_its_result_continues(
    claude: anthropic.Anthropic, qwen_tokenizer: Any, template: str, stream: bool
) -> None:
    # Greedy: a sampled run of the random tiny model could write arguments that are not
    # an object of the schema's fields before its budget (seen once in a full suite).
    args: dict[str, Any] = dict(
        model=MODEL,
        max_tokens=100,
        tools=[WEATHER, TIME],
        **GREEDY,
        messages=ASK,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    if stream:
        with claude.messages.stream(**args) as s:
            events = list(s)
            message = s.get_final_message()
        partial = "".join(
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        assert len([e for e in events if e.type == "content_block_delta"]) > 2  # as generated
    else:
        message = claude.messages.create(**args)
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    if stream:
        assert json.loads(partial) == use.input
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "21 degrees"}],
                }
            ],
        },
    ]
    # The result is in the prompt the next turn continues.
    chat_history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": use.input},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "21 degrees"},
    ]
    tools = [as_chat_tool(WEATHER), as_chat_tool(TIME)]
    counted = claude.messages.count_tokens(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],
    )  # type: ignore[list-item]
    assert counted.input_tokens == len(render_ids(qwen_tokenizer, template, chat_history, tools))
    final = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=[WEATHER, TIME],
        tool_choice={"type": "none"},
        messages=history,
    )  # type: ignore[arg-type,list-item]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == (
        counted.input_tokens
    )
    assert [b.type for b in final.content] in (["text"], [])


def test_any_tool_choice_calls_one_of_the_tools(claude: anthropic.Anthropic) -> None:
    for seed_text in ("Paris?", "Berlin?"):
        message = claude.messages.create(
            model=MODEL,
            max_tokens=120,
            tools=[WEATHER, TIME],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": seed_text}],
        )  # type: ignore[list-item]
        assert message.stop_reason == "tool_use"
        (use,) = message.content  # one call: parallel use was turned off
        assert use.type == "tool_use"
        jsonschema.validate(
            use.input, {"get_weather": WEATHER, "get_time": TIME}[use.name]["input_schema"]
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_message_and_is_named(
    claude: anthropic.Anthropic, stream: bool
) -> None:
    args: dict[str, Any] = dict(
        model=MODEL,
        max_tokens=24,
        **GREEDY,
        messages=[{"role": "user", "content": "Count with me."}],
    )
    text = text_of(claude.messages.create(**args))
    stop = next(
        text[i : i + 3]
        for i in range(len(text) // 2, len(text))
        if text[i : i + 3].strip() and len(text[i : i + 3]) == 3
    )
    if stream:
        events = list(claude.messages.create(stream=True, stop_sequences=["§never§", stop], **args))
        end = events[-2]
        assert (end.delta.stop_reason, end.delta.stop_sequence) == ("stop_sequence", stop)
        got = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    else:
        message = claude.messages.create(stop_sequences=["§never§", stop], **args)
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        got = text_of(message)
    assert got == text[: text.find(stop)]


def test_a_client_that_leaves_mid_stream_frees_its_request(agent_server: LaunchedServer) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 900,
        "stream": True,
        "messages": [{"role": "user", "content": "Talk for a long time."}],
    }
    # msg_<rid hex><8 hex>
    leave_mid_stream(
        agent_server,
        "/v1/messages",
        body,
        "content_block_delta",
        lambda event: int(event["message"]["id"][len("msg_") : -8], 16),
    )


def _error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    kind = {400: "invalid_request_error", 404: "not_found_error", 415: "invalid_request_error"}
    assert body == {
        "type": "error",
        "error": {"type": kind[status], "message": body["error"]["message"]},
    }
    assert needle in body["error"]["message"], body


BASE: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": ASK}
BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"model": MODEL, "messages": ASK}, 400, "max_tokens"),
    ({**BASE, "messages": [{"role": "assistant", "content": "Hi"}, *ASK]}, 400, "first message"),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
        400,
        "unknown content block type 'video'",
    ),
    (
        {
            **BASE,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": ""},
                        }
                    ],
                }
            ],
        },
        400,
        "type 'image' are not supported",
    ),
    (
        {
            **BASE,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "42"}
                    ],
                }
            ],
        },
        400,
        "'toolu_nobody' matches no earlier tool_use",
    ),
    ({**BASE, "max_tokens": "4"}, 400, "max_tokens"),
    ({**BASE, "temperature": "hot"}, 400, "temperature"),
    ({**BASE, "messages": "hello"}, 400, "messages"),
    ({**BASE, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages[0].content[0].text",
    ),
    ({**BASE, "stop_sequences": "STOP"}, 400, "stop_sequences"),
    ({**BASE, "system": 5}, 400, "system"),
    ({**BASE, "tools": [{"name": "get_weather"}]}, 400, "input_schema"),
    (
        {**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "tools[0].type",
    ),
    ({**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope'"),
    ({**BASE, "tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
    ({**BASE, "max_tokens": 0}, 400, "max_tokens"),
    ({**BASE, "max_tokens": 5000}, 400, "maximum context length"),
    ({**BASE, "model": "claude-sonnet-4-5"}, 404, "'claude-sonnet-4-5' does not exist"),
]


def test_bad_input_gets_anthropic_errors_and_loses_nothing(
    claude: anthropic.Anthropic, agent_server: LaunchedServer
) -> None:
    with httpx.Client(base_url=agent_server.url, timeout=30) as client:
        for body, status, needle in BAD:
            _error(client.post("/v1/messages", json=body), status, needle)
        raw = {"content-type": "application/json"}
        _error(
            client.post("/v1/messages", content=b'{"model": "tiny",', headers=raw),
            400,
            "malformed JSON",
        )
        _error(
            client.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"}),
            415,
            "Content-Type",
        )
        _error(client.post("/v1/messages/count_tokens", json={"model": MODEL}), 400, "messages")
        _error(
            client.post(
                "/v1/messages/count_tokens",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
                },
            ),
            400,
            "type 'document' are not supported",
        )
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK reads the shape
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "assistant", "content": "Hi"}]
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    # Nothing was lost: every worker is the one that started, and requests still run.
    assert all(w["alive"] for w in agent_server.health()["workers"])
    assert not [line for line in agent_server.log if "Traceback" in line or "exited" in line]
    assert claude.messages.create(model=MODEL, max_tokens=3, messages=ASK).usage.output_tokens
