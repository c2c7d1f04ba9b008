"""tool_choice 'required': the calls' grammar holds every tool's parameters, and a tool
whose schema uses local $refs ($defs) keeps them working inside it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bundled_models import tiny
from engine.sampling.grammar import GrammarCache
from engine.tokenizer.hf_tokenizer import load_tokenizer
from frontend.api.chat.tools import _required_grammar

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "$defs": {"n": {"type": "integer"}},
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/n"}, "c": {"enum": [{"$ref": "#"}]}},
                "required": ["a"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "g",
            "parameters": {
                "type": "object",
                "$defs": {"s": {"type": "string", "maxLength": 3}},
                "properties": {"b": {"$ref": "#/$defs/s"}, "enum": {"$ref": "#/$defs/s"}},
                "required": ["b"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def compiled() -> Any:
    model = str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH))
    cache = GrammarCache(lambda: load_tokenizer(model), 151936, [151645], model_dir=model)
    spec = _required_grammar(TOOLS, None)
    # Data is never rewritten: an enum value that looks like a $ref stays as it came.
    assert json.loads(spec.text)["$defs"]["tool_0"]["properties"]["c"] == {"enum": [{"$ref": "#"}]}
    return cache.compile_now(spec)


@pytest.mark.parametrize(
    ("calls", "ok"),
    [
        ([{"name": "f", "parameters": {"a": 12}}, {"name": "g", "parameters": {"b": "xy"}}], True),
        ([{"name": "f", "parameters": {"a": "x"}}], False),  # $defs/n: an integer
        ([{"name": "g", "parameters": {"b": "xyzw"}}], False),
        ([{"name": "g", "parameters": {"a": 1}}], False),
        ([{"name": "g", "parameters": {"b": "x", "enum": "y"}}], True),  # a property "enum"
        ([{"name": "g", "parameters": {"b": "x", "enum": 1}}], False),
    ],
)
def test_every_tools_parameters_hold_in_the_required_grammar(
    compiled: Any, calls: list[dict[str, Any]], ok: bool
) -> None:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    accepted = matcher.accept_string(json.dumps(calls))
    assert (accepted and matcher.accept_token(151645)) == ok
