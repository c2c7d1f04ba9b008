"""OpenAI's Responses API on a launched 2P/2D server, driven by the official ``openai`` SDK's
``client.responses`` (issue 27): text streamed and not, function calls, structured output,
usage, disconnects, the refusal to keep state, and errors.

The tiny model's weights are random: the tests compare outputs with each other (greedy
streamed against greedy whole), with the tokenizer and with what the engine reports.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
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

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_SCHEMA,
}


@pytest.fixture(scope="module")
def sdk(agent_server: LaunchedServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=agent_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def template() -> str:
    return TOOLS_TEMPLATE.read_text()


def test_streamed_text_joined_equals_the_whole_response(sdk: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model=MODEL, input="Tell me a story.", max_output_tokens=12, temperature=0
    )
    whole = sdk.responses.create(**args)
    assert whole.object == "response" and whole.model == MODEL and whole.store is False
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.usage is not None and whole.usage.output_tokens == 12
    events = list(sdk.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage is not None
    # The same counts (the repeat's prompt may come from the prefix cache: not compared).
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert final.id == events[0].response.id


def test_a_completed_stream_is_the_sdk_final_response(sdk: openai.OpenAI) -> None:
    """A reply that ends by itself: the SDK's stream helper assembles the same response."""
    args: dict[str, Any] = dict(
        model=MODEL,
        input="Pick a colour.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "colour", "schema": COLOUR}},
    )
    whole = sdk.responses.create(**args)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), COLOUR)
    with sdk.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), COLOUR)


COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


def test_usage_counts_the_tokens_processed(
    sdk: openai.OpenAI, agent_server: LaunchedServer, qwen_tokenizer: Any, template: str
) -> None:
    instructions, text = "You answer briefly.", "A prompt only the usage test sends: " + "r " * 40
    conversation = [{"role": "system", "content": instructions}, {"role": "user", "content": text}]
    prompt = render_ids(qwen_tokenizer, template, conversation)
    args: dict[str, Any] = dict(
        model=MODEL, instructions=instructions, input=text, max_output_tokens=6, temperature=0
    )
    before = computed_prefill_tokens(agent_server)
    first = sdk.responses.create(**args)
    assert first.usage is not None
    assert (first.usage.input_tokens, first.usage.input_tokens_details.cached_tokens) == (
        len(prompt),
        0,
    )
    assert computed_prefill_tokens(agent_server) - before == len(prompt)
    ids = greedy_chat_ids(agent_server, MODEL, conversation, 6)
    assert first.usage.output_tokens == len(ids) == 6
    assert first.usage.total_tokens == len(prompt) + 6
    again = sdk.responses.create(**args)
    assert again.usage is not None and again.usage.input_tokens == len(prompt)
    assert again.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_validates_and_its_output_continues(
    sdk: openai.OpenAI, qwen_tokenizer: Any, template: str, stream: bool
) -> None:
    args: dict[str, Any] = dict(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
    )
    if stream:
        events = list(sdk.responses.create(stream=True, **args))
        call = events[-1].response.output[0]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 2 and "".join(deltas) == call.arguments  # streamed as generated
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done[0].arguments == call.arguments and events[-1].type == "response.completed"
    else:
        response = sdk.responses.create(**args)
        assert response.status == "completed"
        (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    history: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
            "id": call.id,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"},
    ]
    follow = sdk.responses.create(
        model=MODEL, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=6
    )
    assert follow.output[0].type == "message"
    chat_tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER["description"],
            "parameters": WEATHER_SCHEMA,
        },
    }
    want = render_ids(
        qwen_tokenizer,
        template,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"},
        ],
        [chat_tool],
    )
    assert follow.usage is not None and follow.usage.input_tokens == len(want)


def test_a_client_that_leaves_mid_stream_frees_its_request(agent_server: LaunchedServer) -> None:
    body = {
        "model": MODEL,
        "input": "Talk for a long time.",
        "max_output_tokens": 900,
        "stream": True,
    }
    # resp_<rid hex><8 hex>
    leave_mid_stream(
        agent_server,
        "/v1/responses",
        body,
        "response.output_text.delta",
        lambda event: int(event["response"]["id"][len("resp_") : -8], 16),
    )


BASE: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
BAD: list[tuple[dict[str, Any], str]] = [
    ({**BASE, "previous_response_id": "resp_123"}, "keeps no responses"),
    ({**BASE, "store": True}, "keeps no responses"),
    ({**BASE, "input": [{"role": "assistant", "content": "Hi"}]}, "start with a user message"),
    (
        {
            **BASE,
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "x"}],
                }
            ],
        },
        "type 'input_image' are not supported",
    ),
    ({**BASE, "input": [{"type": "web_search_call", "id": "ws_1"}]}, "'web_search_call'"),
    (
        {
            **BASE,
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"},
            ],
        },
        "'call_x' matches no earlier function_call",
    ),
    ({**BASE, "max_output_tokens": "4"}, "max_output_tokens"),
    ({**BASE, "temperature": "warm"}, "temperature"),
    ({**BASE, "input": 5}, "input"),
    ({**BASE, "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({**BASE, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "'nope'"),
    ({**BASE, "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    (
        {**BASE, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
        "'not'",
    ),
    ({**BASE, "reasoning": {"effort": "high"}}, "reasoning"),
    ({**BASE, "model": "gpt-5"}, "'gpt-5' does not exist"),
]


def test_bad_input_gets_openai_errors_and_loses_nothing(
    sdk: openai.OpenAI, agent_server: LaunchedServer
) -> None:
    with httpx.Client(base_url=agent_server.url, timeout=30) as client:
        for body, needle in BAD:
            r = client.post("/v1/responses", json=body)
            assert r.status_code == (404 if body["model"] != MODEL else 400), r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert needle in error["message"], (body, error)
        r = client.post(
            "/v1/responses", content=b'{"input": "x"', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        sdk.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert all(w["alive"] for w in agent_server.health()["workers"])
    assert not [line for line in agent_server.log if "Traceback" in line or "exited" in line]
    assert sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3).output
