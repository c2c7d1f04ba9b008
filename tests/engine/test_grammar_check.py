"""A compiled grammar whose language is empty is a GrammarError that says so, on every
process that compiles it: no output can complete it (a rule cycle with no base case), or
no token of the vocabulary can start it. Grammars with some output compile as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bundled_models import tiny
from engine.sampling.grammar import GrammarCache, GrammarError
from engine.sampling.grammar_check import emptiness, first_token_allowed, unproductive_root
from engine.tokenizer.hf_tokenizer import load_tokenizer
from wire.params import GrammarKind, GrammarSpec

EOS = 151645  # <|im_end|>


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    model: Path = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    return GrammarCache(lambda: load_tokenizer(str(model)), 151936, [EOS], model_dir=str(model))


def _schema(schema: Any) -> GrammarSpec:
    return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(schema))


def _ebnf(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(text)


CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}


@pytest.mark.parametrize(
    ("schema", "rules"),
    [
        ({"$ref": "#"}, "its rule 'root' always needs another copy of itself"),
        (
            {"$defs": {"a": CYCLE}, "$ref": "#/$defs/a"},
            "each of its rules root, defs_a, defs_a_prop_0 always needs another",
        ),
        (
            {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
            "each of its rules root, root_prop_0",
        ),
        (
            {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
            "rules root",
        ),
    ],
)
def test_a_schema_that_must_contain_itself_admits_no_output(
    cache: GrammarCache, schema: Any, rules: str
) -> None:
    with pytest.raises(GrammarError, match=r"^schema admits no output: it can never be") as e:
        cache.compile_now(_schema(schema))
    assert rules in str(e.value) and "no base case" in str(e.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"x": {"$ref": "#"}}},  # x is optional: {} ends it
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]},
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}},
    ],
)
def test_recursive_schemas_with_a_base_case_compile(cache: GrammarCache, schema: Any) -> None:
    assert cache.compile_now(_schema(schema)) is not None


def test_an_ebnf_grammar_without_a_base_case_admits_no_output(cache: GrammarCache) -> None:
    spec = GrammarSpec(kind=GrammarKind.EBNF, text='root ::= "(" root ")"')
    with pytest.raises(GrammarError, match=r"^ebnf admits no output: .*'root'"):
        cache.compile_now(spec)
    ok = GrammarSpec(kind=GrammarKind.EBNF, text='root ::= "(" root ")" | "x"')
    assert cache.compile_now(ok) is not None


@pytest.mark.parametrize(
    ("text", "stuck"),
    [
        ('root ::= a\na ::= "x" a', ["root", "a"]),
        ('root ::= a{2,3}\na ::= b\nb ::= a "y"', ["root", "a", "b"]),
        ('root ::= a{0,3}\na ::= "y" a', None),  # zero repeats is a finite string
        ('root ::= "x" | root "y"', None),
        ('root ::= [a-z]* b\nb ::= "" | b "z"', None),
    ],
)
def test_the_unproductive_rules_are_the_least_fixpoints_complement(
    text: str, stuck: list[str] | None
) -> None:
    found = unproductive_root(_ebnf(text))
    assert (sorted(found) if found else None) == (sorted(stuck) if stuck else None)
    if found:
        assert found[0] == "root"


def test_a_grammar_no_token_can_start_is_found_by_its_first_mask() -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(["a", "b", "ab", "</s>"], stop_token_ids=[3])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    source = xgr.Grammar.from_ebnf('root ::= "c"')  # nonempty, but no token spells "c"
    never = compiler.compile_grammar(source)
    assert unproductive_root(source) is None
    assert not first_token_allowed(never, 4)
    assert emptiness(source, never, 4) == "no token of the model's vocabulary can start it"
    fine = compiler.compile_grammar('root ::= "a" "b"?')
    assert first_token_allowed(fine, 4) and emptiness(None, fine, 4) is None
