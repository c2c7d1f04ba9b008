"""A field of the wrong type is a 400 naming its path, in every API (issue 36).

The six bodies a hostile probe found answered with a 500 (a content block's or part's
``type`` given as a list or an object: in a Messages content block, a ``tool_result``
part, a ``count_tokens`` block, a Responses input part and output part), the same in a
function_call_output's parts and in a chat content part, on the launched agent server.
Each must be a 400 in its API's own error shape, naming the field's path.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.conftest import AGENT_MODEL as MODEL

WRONG_TYPES = [["text"], {"text": "hi"}]
USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def messages(content: list[Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def tool_result(part: dict[str, Any]) -> dict[str, Any]:
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [part]}
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [result]},
    ]
    return {"model": MODEL, "max_tokens": 4, "messages": turns}


def responses(items: list[Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 4, "input": items}


# (path, body with the wrong ``type`` at ``where``, where)
CASES: list[tuple[str, Any, str]] = [
    (
        "/v1/messages",
        lambda t: messages([{"type": t, "text": "hi"}]),
        "messages[0].content[0].type",
    ),
    (
        "/v1/messages",
        lambda t: tool_result({"type": t, "text": "r"}),
        "messages[2].content[0].content[0].type",
    ),
    (
        "/v1/messages/count_tokens",
        lambda t: messages([{"type": t, "text": "hi"}]),
        "messages[0].content[0].type",
    ),
    (
        "/v1/responses",
        lambda t: responses([{"role": "user", "content": [{"type": t, "text": "hi"}]}]),
        "input[0].content[0].type",
    ),
    (
        "/v1/responses",
        lambda t: responses(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": t, "text": "a"}]},
            ]
        ),
        "input[1].content[0].type",
    ),
    (
        "/v1/responses",
        lambda t: responses(
            [
                {"role": "user", "content": "q"},
                CALL,
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": t, "text": "r"}],
                },
            ]
        ),
        "input[2].output[0].type",
    ),
    (
        "/v1/chat/completions",
        lambda t: {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": t, "text": "hi"}]}],
        },
        "messages[0].content[0].type",
    ),
]


@pytest.mark.parametrize("wrong", WRONG_TYPES, ids=["list", "object"])
@pytest.mark.parametrize(("path", "body", "where"), CASES)
def test_a_type_of_the_wrong_type_is_a_400_naming_its_path(
    agent_server: LaunchedServer, path: str, body: Any, where: str, wrong: Any
) -> None:
    r = httpx.post(agent_server.url + path, json=body(wrong), timeout=30)
    assert r.status_code == 400, r.text
    payload = r.json()
    if path.startswith("/v1/messages"):  # Anthropic's shape: the path is in the message
        assert payload["type"] == "error", payload
        assert payload["error"]["type"] == "invalid_request_error", payload
        assert f"'{where}'" in payload["error"]["message"], payload
    else:
        assert payload["error"]["type"] == "invalid_request_error", payload
        assert payload["error"]["param"] == where, payload
        assert f"'{where}'" in payload["error"]["message"], payload


def test_the_same_bodies_with_a_string_type_are_served(agent_server: LaunchedServer) -> None:
    """The 400s above are about the type alone: with ``"text"`` each body is answered."""
    for path, body, _ in CASES:
        r = httpx.post(agent_server.url + path, json=body("text"), timeout=60)
        assert r.status_code == 200, (path, r.text)
