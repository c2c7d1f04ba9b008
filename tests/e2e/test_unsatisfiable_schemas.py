"""A schema no output satisfies is a 400 that says so, at validation, on every endpoint
and field that takes one: before any worker sees the request, at any temperature (one
such request used to kill the prefill worker that sampled it, and a greedy one was
answered with unconstrained text). The workers are the same processes afterwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.conftest import AGENT_MODEL as MODEL
from tests.e2e.helpers import reported_pids

CYCLE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
# Each form, and what the refusal must say of it.
FORMS: dict[str, tuple[Any, str]] = {
    "self_ref": ({"$ref": "#"}, "loop of '$ref's"),
    "ref_cycle": ({"$defs": {"node": CYCLE}, "$ref": "#/$defs/node"}, "no base case"),
    "not_anything": ({"not": {}}, "'not' excludes every value"),
    "false": (False, "the schema is false"),
    "string_lengths": ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength' 5"),
    "integer_range": ({"type": "integer", "minimum": 5, "maximum": 1}, "no number"),
    "empty_enum": ({"enum": []}, "'enum' is an empty list"),
    "disjoint_all_of": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "share no type"),
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Give me JSON."}]}
PROMPT = {"model": MODEL, "prompt": "Give me JSON."}


def _fn(schema: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


Spelling = Callable[[Any], tuple[str, dict[str, Any]]]  # schema -> (path, request body)
# The schema fields chat and completions take alike, each wrapping the schema its way.
OPENAI_FIELDS: dict[str, Callable[[Any], Any]] = {
    "response_format": lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
    "guided_json": lambda s: s,
}
OPENAI_ENDPOINTS = {
    "chat": ("/v1/chat/completions", CHAT),
    "completions": ("/v1/completions", PROMPT),
}


def _openai_field(path: str, base: dict[str, Any], field: str) -> Spelling:
    return lambda s: (path, {**base, field: OPENAI_FIELDS[field](s)})


# endpoint spelling -> (path, body with the schema in its place)
SPELLINGS: dict[str, Spelling] = {
    **{
        f"{api}.{field}": _openai_field(path, base, field)
        for api, (path, base) in OPENAI_ENDPOINTS.items()
        for field in OPENAI_FIELDS
    },
    "chat.structured_outputs": lambda s: (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"json": s}},
    ),
    "chat.named_tool": lambda s: (
        "/v1/chat/completions",
        {**CHAT, "tools": [_fn(s)], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ),
    "chat.required_tool": lambda s: (
        "/v1/chat/completions",
        {**CHAT, "tools": [_fn(s)], "tool_choice": "required"},
    ),
    "messages.output_config": lambda s: (
        "/v1/messages",
        {**CHAT, "output_config": {"format": {"type": "json_schema", "schema": s}}},
    ),
    "messages.forced_tool": lambda s: (
        "/v1/messages",
        {
            **CHAT,
            "tools": [{"name": "f", "input_schema": s}],
            "tool_choice": {"type": "tool", "name": "f"},
        },
    ),
    "responses.text_format": lambda s: (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "Give me JSON.",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": s}},
        },
    ),
    "responses.forced_tool": lambda s: (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "Give me JSON.",
            "tools": [{"type": "function", "name": "f", "parameters": s}],
            "tool_choice": {"type": "function", "name": "f"},
        },
    ),
}
# Fields typed as JSON objects refuse ``false`` as a type error before any schema check.
OBJECT_ONLY = {
    "chat.guided_json",
    "completions.guided_json",
    "chat.named_tool",
    "chat.required_tool",
    "messages.forced_tool",
    "responses.forced_tool",
}


@pytest.fixture(scope="module")
def http(agent_server: LaunchedServer) -> Any:
    with httpx.Client(base_url=agent_server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_unsatisfiable_form_is_a_400_saying_why(
    agent_server: LaunchedServer, http: httpx.Client, spelling: str
) -> None:
    before = reported_pids(agent_server)
    for name, (schema, why) in FORMS.items():
        for temperature in (0.0, 1.0):
            path, body = SPELLINGS[spelling](schema)
            limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
            r = http.post(path, json={**body, limit: 8, "temperature": temperature})
            assert r.status_code == 400, (name, temperature, r.text)
            message = r.json()["error"]["message"]
            if schema is False and spelling in OBJECT_ONLY:
                assert "dict" in message or "object" in message, (name, message)
            else:
                assert "admits no output" in message and why in message, (name, message)
    assert reported_pids(agent_server) == before  # no worker died, none was even asked


def test_a_recursive_schema_with_a_way_out_is_still_served(http: httpx.Client) -> None:
    """The checks refuse empty languages only: a tree whose children are optional ends."""
    tree = {
        "type": "object",
        "properties": {
            "leaf": {"type": "boolean"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
        },
        "required": ["leaf"],
        "additionalProperties": False,
    }
    path, body = SPELLINGS["chat.response_format"](tree)
    r = http.post(path, json={**body, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
