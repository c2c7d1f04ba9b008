"""Tool-call parsers: whole outputs and streams split anywhere give the same calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.api.chat.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedCall,
    RequiredCalls,
)
from frontend.api.chat.tools import ToolCallDeltas, parse_output

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def _stream(parser: Any, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` in pieces of ``step`` characters; (content, [(name, arguments)])."""
    deltas = ToolCallDeltas(parser)
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    content, calls = "", []
    for k, piece in enumerate(pieces):
        delta = deltas.feed(piece, final=k == len(pieces) - 1)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            if "id" in c:  # a call's first delta: index, id, type, name
                assert c["index"] == len(calls) and c["type"] == "function"
                calls.append((c["function"]["name"], c["function"]["arguments"]))
            else:
                name, args = calls[c["index"]]
                calls[c["index"]] = (name, args + c["function"]["arguments"])
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_calls_and_content_whole_or_streamed(step: int) -> None:
    whole = parse_output(HermesParser(), HERMES)
    assert whole.content == "Let me check.\n"
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls
    ] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c["id"].startswith("call_") for c in whole.tool_calls)
    content, calls = _stream(HermesParser(), HERMES, step)
    assert content == whole.content
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all, a < sign and <tool",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f"',
    ],
)
def test_hermes_text_that_is_no_call_stays_content(text: str) -> None:
    assert parse_output(HermesParser(), text).content == text
    assert _stream(HermesParser(), text, 2) == (text, [])


def test_hermes_unclosed_call_that_parses_is_a_call() -> None:
    out = parse_output(HermesParser(), '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert out.content is None and out.tool_calls[0]["function"]["arguments"] == '{"a": 1}'


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_calls(step: int) -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    out = parse_output(Llama3JsonParser(), text)
    assert out.content is None
    assert [c["function"]["name"] for c in out.tool_calls] == ["f", "g"]
    assert _stream(Llama3JsonParser(), text, step)[1] == [("f", '{"x": 1}'), ("g", "{}")]
    plain = "The answer is {probably} 42."
    assert parse_output(Llama3JsonParser(), plain).content == plain
    assert _stream(Llama3JsonParser(), plain, step) == (plain, [])


def test_required_and_named_outputs() -> None:
    out = parse_output(RequiredCalls(), '[{"name": "f", "parameters": {"x": "y"}}]')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out.tool_calls] == [
        ("f", '{"x": "y"}')
    ]
    assert parse_output(RequiredCalls(), '[{"name": "f", "par').content is not None  # cut short
    # A named call streams its arguments as they are generated, one fragment per delta.
    content, calls = _stream(NamedCall("f"), '{"x": "yz"}', 2)
    assert content == "" and calls == [("f", '{"x": "yz"}')]
