"""Integer bounds the grammar engine can take: whole numbers inside int64.

xgrammar 0.2.8 refuses an integer schema whose bound is not a whole number ("Integer
constraint must be a whole number") or lies past int64 ("Integer exceeds maximum limit"),
though the schema is valid and admits integers: ``{"type": "integer", "minimum": 1.5,
"maximum": 2}`` admits 2, ``{"type": "integer", "maximum": 1e20}`` every int64 up to its
top. Before a JSON schema is compiled (``grammar.compile_spec``, ``grammar.source_grammar``:
both the same text), each node whose only numeric type is ``integer`` gets the inclusive
whole bounds that admit the same integers (minimum 1.5 -> 2, exclusiveMaximum 2.5 ->
maximum 2), a bound past int64 clamped to int64's end (an output past it is then refused;
every other stays allowed). A schema with nothing to change is compiled from its own text.
"""

from __future__ import annotations

import json
import math
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
# Where subschemas sit: name -> schema maps, lists of schemas, and single schemas (or a
# list of them: draft 4's tuple ``items``). Values (const, enum, default) are never walked.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SINGLES = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then")
_SINGLES_TOO = ("else", "unevaluatedItems", "unevaluatedProperties")


def whole_integer_bounds(text: str) -> str:
    """``text`` (a JSON schema) with its integer bounds whole and inside int64; ``text``
    itself when none needed it, or when it is no JSON (the compiler says why)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(schema) if _fix(schema) else text


def _fix(node: Any) -> bool:
    """Rewrite the bounds of every integer node under ``node`` in place; any changed?"""
    if isinstance(node, list):
        return any([_fix(sub) for sub in node])  # a list, not a generator: visit them all
    if not isinstance(node, dict):
        return False
    changed = _integer_only(node) and _whole_bounds(node)
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            changed |= any([_fix(sub) for sub in node[key].values()])
    for key in (*_LISTS, *_SINGLES, *_SINGLES_TOO):
        changed |= _fix(node.get(key))
    return changed


def _integer_only(node: dict[str, Any]) -> bool:
    declared = node.get("type")
    names = [declared] if isinstance(declared, str) else declared
    return isinstance(names, list) and "integer" in names and "number" not in names


def _number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    return isinstance(x, int) or math.isfinite(x)


def _whole_bounds(node: dict[str, Any]) -> bool:
    """Make ``node``'s numeric bounds inclusive, whole and inside int64; changed?"""
    if any(isinstance(node.get(k), bool) for k in _BOUNDS):
        return False  # draft 4's boolean exclusiveMinimum: another meaning, left as it is
    bounds = {k: node[k] for k in _BOUNDS if _number(node.get(k))}
    if all(_fits(v) for v in bounds.values()):
        return False
    lows = [math.ceil(v) for k, v in bounds.items() if k == "minimum"]
    lows += [math.floor(v) + 1 for k, v in bounds.items() if k == "exclusiveMinimum"]
    highs = [math.floor(v) for k, v in bounds.items() if k == "maximum"]
    highs += [math.ceil(v) - 1 for k, v in bounds.items() if k == "exclusiveMaximum"]
    for k in bounds:
        del node[k]
    if lows:
        node["minimum"] = max(max(lows), INT64_MIN)
    if highs:
        node["maximum"] = min(min(highs), INT64_MAX)
    return True


def _fits(v: int | float) -> bool:
    return (isinstance(v, int) or v.is_integer()) and INT64_MIN <= v <= INT64_MAX
