"""HTTP fuzzing of /v1/messages and /v1/responses on the launched server (issue 27): no body
makes a 5xx or kills a worker, and every refusal is in the API's own error shape.

Bodies are built field by field: each field gets a plausible value (often valid, often
just wrong: an unknown block type, an image, a tool_result answering nothing) or, in wild
bodies, arbitrary JSON. The output budget is always a small integer, so that the run stays
short. Afterwards every worker must be the same process as before.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import event, given, settings
from hypothesis import strategies as st

from benchmarks.serving.api_fuzz import any_json, json_leaf
from tests.conftest import LaunchedServer
from tests.e2e.helpers import E2E_FUZZ

FUZZ = settings(E2E_FUZZ, max_examples=40)
MODEL = "tiny-qwen2-v1"
BUDGET = st.integers(-1, 5)
SCHEMA = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}
text = st.text(max_size=12)


def loose(plausible: st.SearchStrategy[Any], wild: bool) -> st.SearchStrategy[Any]:
    """Wild bodies: a quarter of the fields arbitrary JSON."""
    return st.one_of(plausible, plausible, plausible, any_json) if wild else plausible


text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text})
block = st.one_of(
    text_block,
    text_block,
    text_block,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.sampled_from(["t1", "t2"]),
            "name": st.sampled_from(["f", "g"]),
            "input": st.dictionaries(st.text(max_size=3), json_leaf, max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.sampled_from(["t1", "t2"]),
            "content": text
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": text}),
                max_size=2,
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "thinking", "video"]), "source": any_json}
    ),
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "user", "assistant", "system"]),
        "content": text | st.lists(block, min_size=1, max_size=3),
    }
)
anthropic_tool = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name"]), "input_schema": st.just(SCHEMA)},
    optional={"description": text, "type": st.sampled_from(["custom", "web_search_20250305"])},
)
MESSAGES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "system": text
    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "temperature": st.floats(-0.5, 2),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-2, 9),
    "stream": st.booleans(),
    "metadata": st.fixed_dictionaries({"user_id": text}),
    "tools": st.lists(anthropic_tool, max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
        optional={"name": st.sampled_from(["f", "g", "h"])},
    ),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
}

item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "developer", "tool"]),
            "content": text
            | st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["input_text", "output_text", "input_image"]),
                        "text": text,
                    }
                ),
                max_size=2,
            ),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.sampled_from(["c1", "c2"]),
            "name": st.sampled_from(["f", "g"]),
            "arguments": st.sampled_from(['{"x": "a"}', "{}", "not json"]),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.sampled_from(["c1", "c2"]),
            "output": text,
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call"])}),
)
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "instructions": text,
    "temperature": st.floats(-0.5, 2),
    "top_p": st.floats(-0.1, 1.1),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": text,
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function", "function", "web_search"]),
                "name": st.sampled_from(["f", "g"]),
                "parameters": st.just(SCHEMA),
            }
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
    "text": st.fixed_dictionaries(
        {
            "format": st.sampled_from(
                [
                    {"type": "text"},
                    {"type": "json_object"},
                    {"type": "yaml"},
                    {"type": "json_schema", "name": "s", "schema": SCHEMA},
                ]
            )
        }
    ),
    "parallel_tool_calls": st.booleans(),
    "metadata": st.dictionaries(text, text, max_size=2),
}


def messages_body(wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    required = {
        "model": loose(st.sampled_from([MODEL, MODEL, "claude-x"]), wild),
        "max_tokens": BUDGET,
        "messages": loose(st.lists(anthropic_message, min_size=1, max_size=3), wild),
    }
    optional = {k: loose(v, wild) for k, v in MESSAGES_FIELDS.items()}
    return st.fixed_dictionaries(required, optional=optional)


def responses_body(wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    required = {
        "model": loose(st.sampled_from([MODEL, MODEL, "gpt-x"]), wild),
        "max_output_tokens": BUDGET,
        "input": loose(text | st.lists(item, min_size=1, max_size=4), wild),
    }
    optional = {k: loose(v, wild) for k, v in RESPONSES_FIELDS.items()}
    return st.fixed_dictionaries(required, optional=optional)


def post_never_5xx(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST a fuzzed body: any answer but a server error (its status counted for the
    statistics hypothesis prints)."""
    r = http.post(path, json=body)
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, r.text
    return r


def events_of(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a named-event SSE stream."""
    out = []
    for frame in (f for f in r.text.split("\n\n") if f):
        name, data = frame.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), frame
        out.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


@FUZZ
@given(body=st.booleans().flatmap(messages_body))
def test_fuzzed_messages_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    r = post_never_5xx(http, "/v1/messages", body)
    if r.status_code >= 400:
        error = r.json()
        assert error["type"] == "error" and error["error"]["message"], error
        assert error["error"]["type"] in ("invalid_request_error", "not_found_error"), error
    elif r.headers["content-type"].startswith("text/event-stream"):
        names = [name for name, _ in events_of(r)]
        assert names[0] == "message_start" and names[-1] == "message_stop", names
    else:
        assert r.json()["type"] == "message"


@FUZZ
@given(body=st.booleans().flatmap(responses_body))
def test_fuzzed_responses_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    r = post_never_5xx(http, "/v1/responses", body)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
    elif r.headers["content-type"].startswith("text/event-stream"):
        names = [name for name, _ in events_of(r)]
        assert names[0] == "response.created", names
        assert names[-1] in ("response.completed", "response.incomplete"), names
    else:
        assert r.json()["status"] in ("completed", "incomplete")


def test_every_worker_survived_the_fuzzing(
    server: LaunchedServer, worker_pids: dict[tuple[str, int], int]
) -> None:
    health = server.health()
    assert {(w["role"], w["index"]): w["pid"] for w in health["workers"]} == worker_pids
    assert all(w["alive"] for w in health["workers"])
