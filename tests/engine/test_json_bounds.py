"""Integer schemas with fractional bounds or bounds past int64 are valid and admit
integers: they compile, to a grammar that admits exactly the integers the schema does
(xgrammar refused them: "Integer constraint must be a whole number")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bundled_models import tiny
from engine.sampling.grammar import GrammarCache
from engine.sampling.json_bounds import INT64_MAX, INT64_MIN, whole_integer_bounds
from engine.tokenizer.hf_tokenizer import load_tokenizer
from wire.params import GrammarKind, GrammarSpec


def _rewritten(schema: Any) -> Any:
    return json.loads(whole_integer_bounds(json.dumps(schema)))


@pytest.mark.parametrize(
    ("schema", "bounds"),
    [
        ({"type": "integer", "minimum": 1.5, "maximum": 2}, {"minimum": 2, "maximum": 2}),
        ({"type": "integer", "exclusiveMinimum": 0.5}, {"minimum": 1}),
        (
            {"type": "integer", "exclusiveMaximum": 2.5, "minimum": -1.5},
            {"minimum": -1, "maximum": 2},
        ),
        ({"type": "integer", "exclusiveMaximum": 3, "maximum": 2.9}, {"maximum": 2}),
        ({"type": ["integer", "null"], "minimum": 0.1}, {"minimum": 1}),
        ({"type": "integer", "minimum": 0, "maximum": 1e20}, {"minimum": 0, "maximum": INT64_MAX}),
        ({"type": "integer", "minimum": -(10**30)}, {"minimum": INT64_MIN}),
    ],
)
def test_integer_bounds_become_whole_and_inside_int64(schema: Any, bounds: dict[str, int]) -> None:
    out = _rewritten(schema)
    assert {k: v for k, v in out.items() if k != "type"} == bounds
    assert out["type"] == schema["type"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 1, "exclusiveMaximum": 5},  # whole already
        {"type": "integer", "minimum": 1.0, "maximum": 5.0},  # 1.0 is whole
        {"type": "number", "minimum": 1.5, "maximum": 2},  # a number may be 1.7
        {"type": ["integer", "number"], "minimum": 1.5},
        {"type": "integer", "minimum": 1.5, "exclusiveMinimum": True},  # draft 4: left as is
        {"enum": [1.5], "const": 1.5, "default": {"type": "integer", "minimum": 0.5}},
    ],
)
def test_schemas_with_nothing_to_change_keep_their_text(schema: Any) -> None:
    text = json.dumps(schema)
    assert whole_integer_bounds(text) is text
    assert whole_integer_bounds("{not json") == "{not json"


def test_nested_integer_nodes_are_rewritten_wherever_a_subschema_sits() -> None:
    half = {"type": "integer", "minimum": 0.5}
    schema = {
        "type": "object",
        "properties": {"a": half, "minimum": {"type": "integer", "maximum": 9.5}},
        "$defs": {"d": half},
        "anyOf": [half, {"type": "array", "items": half, "prefixItems": [half]}],
    }
    out = _rewritten(schema)
    assert out["properties"]["a"]["minimum"] == 1
    assert out["properties"]["minimum"] == {"type": "integer", "maximum": 9}
    assert out["$defs"]["d"]["minimum"] == 1
    assert out["anyOf"][0]["minimum"] == 1
    assert out["anyOf"][1]["items"]["minimum"] == out["anyOf"][1]["prefixItems"][0]["minimum"] == 1


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    model: Path = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    return GrammarCache(lambda: load_tokenizer(str(model)), 151936, [151645], model_dir=str(model))


def test_a_fractional_integer_bound_compiles_and_admits_the_integers_it_should(
    cache: GrammarCache,
) -> None:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    for schema, inside, outside in [
        ({"type": "integer", "minimum": 1.5, "maximum": 2}, ["2"], ["1", "3", "2.0"]),
        ({"type": "integer", "exclusiveMinimum": 0.5, "exclusiveMaximum": 3.5}, ["1", "3"], ["0"]),
        ({"type": "integer", "minimum": 0, "maximum": 1e20}, ["0", str(INT64_MAX)], ["-1"]),
    ]:
        text = json.dumps(schema)
        assert cache.compile_now(GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=text)) is not None
        grammar = xgr.Grammar.from_json_schema(whole_integer_bounds(text))
        assert all(_is_grammar_accept_string(grammar, s) for s in inside), schema
        assert not any(_is_grammar_accept_string(grammar, s) for s in outside), schema
