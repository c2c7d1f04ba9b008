"""Structured-output fields: every spelling becomes one spec; conflicts and unenforceable
schemas are 400s that name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.api.common.structured import compile_checked, grammar_spec
from frontend.engine_link.grammar_pool import GrammarPool
from frontend.engine_link.grammar_worker import WorkerConfig
from frontend.errors import InvalidRequest, LimitExceeded, NotImplementedField, ServiceUnavailable
from tests.frontend.conftest import make_settings
from tests.frontend.test_protocol import chat, completion
from wire.params import GrammarKind, GrammarSpec, choice_seed

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "kind", "text"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            GrammarKind.JSON_SCHEMA,
            json.dumps(SCHEMA),
        ),
        ({"response_format": {"type": "json_object"}}, GrammarKind.JSON_OBJECT, ""),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            GrammarKind.JSON_SCHEMA,
            json.dumps(SCHEMA),
        ),
        ({"structured_outputs": {"regex": "a+"}}, GrammarKind.REGEX, "a+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, GrammarKind.CHOICE, '["x", "y"]'),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, GrammarKind.EBNF, 'root ::= "a"'),
        ({"structured_outputs": {"json_object": True}}, GrammarKind.JSON_OBJECT, ""),
        ({"guided_json": SCHEMA}, GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ({"guided_regex": "a+"}, GrammarKind.REGEX, "a+"),
        ({"guided_choice": ["x"]}, GrammarKind.CHOICE, '["x"]'),
        ({"guided_grammar": 'root ::= "a"'}, GrammarKind.EBNF, 'root ::= "a"'),
    ],
)
def test_every_spelling_becomes_one_spec(
    fields: dict[str, Any], kind: GrammarKind, text: str
) -> None:
    for body in (chat(**fields), completion(**fields)):
        found = grammar_spec(body)
        assert found is not None
        assert (found[1].kind, found[1].text) == (kind, text)


def test_no_constraint_and_text_format_mean_none() -> None:
    assert grammar_spec(chat()) is None
    assert grammar_spec(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"not": {}}}}}, "guided_json"),
        ({"guided_json": {"$ref": "https://example.com/s.json"}}, "guided_json"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ],
)
def test_bad_constraints_name_their_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises((InvalidRequest, NotImplementedField)) as info:
        grammar_spec(chat(**fields))
    assert info.value.param == param


def test_a_property_named_like_a_keyword_is_not_a_keyword() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {}}}
    assert grammar_spec(chat(guided_json=schema)) is not None


def test_choice_seeds_are_distinct_and_keep_choice_zero() -> None:
    seeds = [choice_seed(42, i) for i in range(16)]
    assert seeds[0] == 42 and len(set(seeds)) == 16
    assert all(-(2**63) <= s < 2**63 for s in [*seeds, choice_seed(-1, 3)])


@pytest.mark.anyio
async def test_an_oversized_constraint_is_refused_before_it_compiles() -> None:
    pool = GrammarPool(WorkerConfig(model_dir="", vocab_size=1, stop_ids=[]), timeout_s=1.0)
    spec = GrammarSpec(kind=GrammarKind.REGEX, text="x" * 70_000)
    with pytest.raises(LimitExceeded) as info:
        await compile_checked(pool, spec, "guided_regex", make_settings())
    assert (info.value.limit, info.value.param) == ("max_schema_bytes", "guided_regex")
    assert "70000 bytes" in info.value.message and "--max-schema-bytes" in info.value.message
    assert pool.compiles == 0  # refused before any worker saw it


@pytest.mark.anyio
async def test_a_grammar_worker_that_cannot_start_is_a_503_naming_why(tmp_path: Any) -> None:
    config = WorkerConfig(model_dir=str(tmp_path / "missing"), vocab_size=8, stop_ids=[0])
    pool = GrammarPool(config, timeout_s=1.0)
    try:
        with pytest.raises(ServiceUnavailable) as info:
            await compile_checked(
                pool, GrammarSpec(kind=GrammarKind.JSON_OBJECT), "response_format", make_settings()
            )
    finally:
        await pool.close()
    assert info.value.status == 503 and info.value.headers() == {"Retry-After": "1"}
    assert "failed to start: it exited with status" in info.value.message
