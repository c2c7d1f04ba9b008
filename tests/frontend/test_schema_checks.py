"""JSON schemas no value satisfies are refused on their face, with a message that says
what is contradictory and where; schemas with some value pass untouched."""

from __future__ import annotations

from typing import Any

import pytest

from frontend.api.common.schema_checks import check_satisfiable, problem
from frontend.api.common.structured import grammar_spec
from frontend.errors import InvalidRequest, NotImplementedField
from tests.frontend.test_protocol import chat

LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize(
    ("schema", "where", "why"),
    [
        (False, "#", "the schema is false"),
        ({"$ref": "#"}, "#", "'$ref' '#' leads only into a loop"),
        ({**LOOP, "properties": {"x": {"$ref": "#/$defs/a"}}}, "#/properties/x", "loop"),
        ({"not": {}}, "#", "'not' excludes every value"),
        ({"not": True}, "#", "'not' excludes every value"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "#", "'minLength' 5 is greater"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "#", "'minItems' 3"),
        ({"type": "object", "minProperties": 2, "maxProperties": 0}, "#", "'minProperties'"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "#", "bounds leave no number"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "#", "bounds leave no number"),
        ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "#", "no integer lies between"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "#", "no integer"),
        ({"enum": []}, "#", "'enum' is an empty list"),
        ({"anyOf": []}, "#", "'anyOf' is an empty list"),
        ({"oneOf": []}, "#", "'oneOf' is an empty list"),
        ({"type": []}, "#", "'type' is an empty list"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "#", "'allOf' share no type"),
        ({"type": "string", "allOf": [{"type": "number"}]}, "#", "'allOf' share no type"),
        ({"type": "integer", "const": "x"}, "#", "admit no common value"),
        ({"type": "string", "enum": [1, 2.5, None]}, "#", "admit no common value"),
        ({"const": 3, "enum": [1, 2]}, "#", "'const' is not one of its 'enum'"),
        (
            {"type": "object", "required": ["a"], "additionalProperties": False},
            "#",
            "it requires 'a', which 'additionalProperties': false forbids",
        ),
        ({"type": "object", "required": ["a", "b"], "maxProperties": 1}, "#", "requires 2"),
        (
            {"type": "object", "properties": {"p": {"type": "array", "items": {"enum": []}}}},
            "#/properties/p/items",
            "'enum' is an empty list",
        ),
        ({"$defs": {"d": {"type": []}}}, "#/$defs/d", "'type' is an empty list"),
        ({"prefixItems": [{"type": "string"}, {"anyOf": []}]}, "#/prefixItems/1", "'anyOf'"),
    ],
)
def test_an_empty_schema_is_found_where_it_is_empty(schema: Any, where: str, why: str) -> None:
    found = problem(schema)
    assert found is not None and found[0] == where and why in found[1], found


@pytest.mark.parametrize(
    "schema",
    [
        True,
        {},
        {"type": "object", "properties": {"x": {"$ref": "#"}}},  # recursion with a way out
        {"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"},
        {"type": "integer", "minimum": 1, "maximum": 1},
        {"type": "number", "minimum": 1.2, "maximum": 1.8},
        {"type": ["string", "null"], "enum": ["a", None]},
        {"type": "number", "const": 3},
        {"type": "integer", "enum": [1.0, "x"]},  # 1.0 is an integer
        {"minLength": 5, "maxLength": 2},  # no type: a number satisfies it
        {
            "type": "object",
            "required": ["a"],
            "additionalProperties": False,
            "properties": {"a": {}},
        },
        {
            "type": "object",
            "required": ["a"],
            "patternProperties": {"^a$": {}},
            "additionalProperties": False,
        },
        {"not": {"type": "string"}},
        {"type": "object", "properties": {"not": {}, "enum": {"type": "string"}}},
        # Malformed parts (unhashable type names and required names) are not judged: no
        # TypeError (it was a 500); the compiler says what is wrong with them.
        {"type": [{}]},
        {"type": [["integer"]], "minimum": 2, "maximum": 1},
        {"type": "object", "required": [{}], "additionalProperties": False},
    ],
)
def test_schemas_with_some_value_pass(schema: Any) -> None:
    assert problem(schema) is None
    check_satisfiable(schema, "p")


def test_the_refusal_says_admits_no_output_and_names_the_field() -> None:
    with pytest.raises(InvalidRequest) as e:
        check_satisfiable({"type": "object", "properties": {"a": {"enum": []}}}, "tools[0]")
    assert e.value.param == "tools[0]"
    assert e.value.message == (
        "schema admits no output: at #/properties/a, 'enum' is an empty list"
    )
    with pytest.raises(InvalidRequest, match=r"^schema admits no output: 'not' excludes"):
        check_satisfiable({"not": {}}, "p")


@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_every_schema_field_refuses_an_empty_schema(field: str) -> None:
    schema = {"$ref": "#"}
    fields: dict[str, Any] = (
        {field: schema}
        if field == "guided_json"
        else {field: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    )
    with pytest.raises(InvalidRequest, match="admits no output"):
        grammar_spec(chat(**fields))


def test_an_all_of_of_several_schemas_is_refused_as_not_enforced() -> None:
    """xgrammar drops such an allOf, and the keywords beside it, without a word."""
    schema = {"type": "integer", "allOf": [{"minimum": 3}, {"maximum": 5}]}
    with pytest.raises(NotImplementedField, match="'allOf' of several schemas"):
        grammar_spec(chat(guided_json=schema))
    assert grammar_spec(chat(guided_json={"allOf": [{"type": "integer"}]})) is not None


def test_a_long_chain_of_refs_is_followed_once_not_once_per_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check runs on the event loop before any size limit: a chain of n '$ref's must
    cost n resolutions (each link walking the rest of the chain made it cubic: 37 s for
    2,000 links)."""
    from frontend.api.common import schema_checks

    calls = 0
    resolve = schema_checks._resolve

    def counted(root: Any, ref: str) -> Any:
        nonlocal calls
        calls += 1
        return resolve(root, ref)

    monkeypatch.setattr(schema_checks, "_resolve", counted)
    n = 3000
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    assert problem({"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}) is None
    assert calls <= n + 1, calls
    calls = 0
    looped = {"$defs": {**defs, f"d{n}": {"$ref": "#/$defs/d1"}}, "$ref": "#/$defs/d0"}
    found = problem(looped)
    assert found is not None and found[0] == "#" and "loop of '$ref's" in found[1], found
    assert calls <= n + 2, calls


def test_integers_past_a_floats_range_are_judged_not_raised() -> None:
    """A JSON integer of 400 digits decodes as a Python int that ``math.isfinite`` cannot
    take: the check compares it exactly (it was an OverflowError: a 500)."""
    huge = 10**400
    found = problem({"type": "integer", "minimum": huge, "maximum": 1})
    assert found is not None and "bounds leave no number" in found[1], found
    found = problem({"type": "string", "minLength": huge, "maxLength": 3})
    assert found is not None and "'minLength'" in found[1], found
    assert problem({"type": "integer", "minimum": 1, "maximum": huge}) is None
    assert problem({"type": "string", "minLength": 1, "maxLength": huge}) is None
    assert problem({"type": "integer", "minimum": 0.5, "exclusiveMaximum": huge}) is None


def test_a_ref_into_a_list_takes_ascii_indices_only() -> None:
    """'²' is a digit to ``str.isdigit`` but not to ``int`` (it was a ValueError: a 500);
    a pointer index that is not ASCII digits names nothing."""
    assert problem({"anyOf": [{"type": "string"}], "items": {"$ref": "#/anyOf/\u00b2"}}) is None
    assert problem({"anyOf": [{"type": "string"}], "items": {"$ref": "#/anyOf/-1"}}) is None
    found = problem({"anyOf": [{"$ref": "#/anyOf/0"}]})
    assert found == ("#/anyOf/0", "its '$ref' '#/anyOf/0' leads only into a loop of '$ref's")
