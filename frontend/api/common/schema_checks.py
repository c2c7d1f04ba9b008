"""JSON schemas no value satisfies, found by reading the schema (no compile).

A constraint whose language is empty has nothing to sample: it is refused with a 400
saying why and where. This module catches the contradictions a reader sees at one node
(``{"not": {}}``, ``minLength`` above ``maxLength``, an empty ``enum``, ``allOf`` of
disjoint types, a ``$ref`` that is only itself); what needs the whole grammar (a
definition that must contain itself with no base case) is found when the grammar is
compiled (engine/sampling/grammar_check.py). ``problem`` is pure: it returns the reason.

It runs on the frontend's event loop before the schema's size is checked, so it is linear
in the schema: each '$ref' chain is followed once per check, not once per node on it (a
chain of 2,000 '$ref's, 70 kB, took 37 s when every node walked the rest of its chain).
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from frontend.errors import InvalidRequest

_NUMBER = frozenset({"integer", "fraction"})
# A JSON-schema type name -> the value kinds it admits (a number is an integer or not).
_KINDS: dict[str, frozenset[str]] = {
    "null": frozenset({"null"}),
    "boolean": frozenset({"boolean"}),
    "object": frozenset({"object"}),
    "array": frozenset({"array"}),
    "string": frozenset({"string"}),
    "integer": frozenset({"integer"}),
    "number": _NUMBER,
}
_ANY = frozenset().union(*_KINDS.values())
# (lower keyword, upper keyword, the kind they bound)
_LENGTHS = (
    ("minLength", "maxLength", "string"),
    ("minItems", "maxItems", "array"),
    ("minProperties", "maxProperties", "object"),
)
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# NOTE: 'not' is not walked: a subschema under it may well admit nothing.
_SINGLES = ("items", "additionalProperties", "propertyNames", "contains")


def check_satisfiable(schema: Any, param: str) -> None:
    """A 400 naming ``param`` if some part of ``schema`` admits no value."""
    found = problem(schema)
    if found is not None:
        where, why = found
        at = "" if where == "#" else f"at {where}, "
        raise InvalidRequest(f"schema admits no output: {at}{why}", param=param)


def problem(schema: Any) -> tuple[str, str] | None:
    """(JSON pointer, reason) of the first node of ``schema`` no value satisfies."""
    if schema is False:
        return "#", "the schema is false"
    return _walk(schema, _Refs(schema), "#")


def _walk(node: Any, root: _Refs, where: str) -> tuple[str, str] | None:
    if not isinstance(node, dict):
        return None
    why = _node_problem(node, root)
    if why is not None:
        return where, why
    for key in _MAPS:
        subs = node.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                if (found := _walk(sub, root, f"{where}/{key}/{_escape(name)}")) is not None:
                    return found
    for key in _LISTS:
        subs = node.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                if (found := _walk(sub, root, f"{where}/{key}/{i}")) is not None:
                    return found
    for key in _SINGLES:
        sub = node.get(key)
        subs = enumerate(sub) if isinstance(sub, list) else [(None, sub)]
        for i, one in subs:
            at = f"{where}/{key}" if i is None else f"{where}/{key}/{i}"
            if (found := _walk(one, root, at)) is not None:
                return found
    return None


def _node_problem(node: dict[str, Any], root: _Refs) -> str | None:
    """Why no value satisfies ``node`` itself (its own keywords), or None."""
    if node.get("not") is True or node.get("not") == {}:
        return "'not' excludes every value"
    for key in ("enum", "anyOf", "oneOf", "type"):
        if node.get(key) == []:
            return f"'{key}' is an empty list"
    if root.loops(node):
        return f"its '$ref' {node['$ref']!r} leads only into a loop of '$ref's"
    kinds = _kinds(node)
    if not kinds:
        return "its 'type', 'const' and 'enum' admit no common value"
    if "const" in node and isinstance(node.get("enum"), list) and node["const"] not in node["enum"]:
        return "its 'const' is not one of its 'enum'"
    for low, high, kind in _LENGTHS:
        lo, hi = node.get(low), node.get(high)
        if kinds == {kind} and _number(lo) and _number(hi) and lo > hi:
            return f"'{low}' {lo} is greater than '{high}' {hi}"
    if kinds <= _NUMBER and (why := _range_problem(node, kinds)) is not None:
        return why
    return _all_of_problem(node, kinds) or _object_problem(node, kinds)


def _kinds(node: dict[str, Any]) -> frozenset[str]:
    """The value kinds ``node``'s 'type', 'const' and 'enum' leave (all, if none given)."""
    kinds = _ANY
    declared = node.get("type")
    names = [declared] if isinstance(declared, str) else declared
    if isinstance(names, list) and all(isinstance(n, str) and n in _KINDS for n in names):
        kinds = frozenset().union(*(_KINDS[n] for n in names))
    if "const" in node:
        kinds &= _kind_of(node["const"])
    if isinstance(node.get("enum"), list) and node["enum"]:
        kinds &= frozenset().union(*(_kind_of(v) for v in node["enum"]))
    return kinds


def _kind_of(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return frozenset({"integer"})
    if isinstance(value, float):
        return frozenset({"fraction"})
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array" if isinstance(value, list) else "object"})


def _number(x: Any) -> TypeGuard[int | float]:
    # NOTE: an int is always finite, and math.isfinite raises OverflowError on one past
    # a float's range (a JSON integer of 309 digits decodes as such an int).
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    return isinstance(x, int) or math.isfinite(x)


def _range_problem(node: dict[str, Any], kinds: frozenset[str]) -> str | None:
    """A numeric node whose bounds leave no number (no integer, for an integer)."""
    lo, lo_open = _bound(node, "minimum", "exclusiveMinimum", max)
    hi, hi_open = _bound(node, "maximum", "exclusiveMaximum", min)
    if lo is None or hi is None:
        return None
    if lo > hi or (lo == hi and (lo_open or hi_open)):
        return f"its bounds leave no number (from {lo} to {hi})"
    if kinds == {"integer"}:
        first = math.floor(lo) + 1 if lo_open else math.ceil(lo)
        last = math.ceil(hi) - 1 if hi_open else math.floor(hi)
        if first > last:
            return f"no integer lies between {lo} and {hi}"
    return None


def _bound(node: dict[str, Any], closed: str, open_: str, pick: Any) -> tuple[Any, bool]:
    """The tighter of a closed and an open bound: (value, is it open), or (None, False)."""
    bounds = [(node[k], k == open_) for k in (closed, open_) if _number(node.get(k))]
    if not bounds:
        return None, False
    value = pick(v for v, _ in bounds)
    return value, any(v == value and is_open for v, is_open in bounds)


def _all_of_problem(node: dict[str, Any], kinds: frozenset[str]) -> str | None:
    parts = node.get("allOf")
    if not isinstance(parts, list):
        return None
    for part in parts:
        if isinstance(part, dict):
            kinds &= _kinds(part)
        elif part is False:
            return "'allOf' holds the false schema"
    return None if kinds else "the schemas of 'allOf' share no type"


def _object_problem(node: dict[str, Any], kinds: frozenset[str]) -> str | None:
    """An object node whose required properties it forbids or cannot hold."""
    required = node.get("required")
    if kinds != {"object"} or not isinstance(required, list):
        return None
    most, names = node.get("maxProperties"), set(map(str, required))
    if _number(most) and len(names) > most:
        return f"it requires {len(names)} properties but 'maxProperties' is {most}"
    props = node.get("properties")
    props = props if isinstance(props, dict) else {}
    if node.get("additionalProperties") is False and not node.get("patternProperties"):
        for name in required:
            if isinstance(name, str) and name not in props:  # (a dict name is no name)
                return f"it requires {name!r}, which 'additionalProperties': false forbids"
    return None


class _Refs:
    """The local '$ref's of one schema, and which of its nodes lead only into a loop of
    them, each node judged once (``_verdicts``: its id -> the verdict)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._verdicts: dict[int, bool] = {}

    def loops(self, node: dict[str, Any]) -> bool:
        """Does following ``node``'s '$ref' (and the '$ref' of each target that is nothing
        but one) come back to a schema already passed?"""
        path: list[int] = []
        on_path: set[int] = set()
        verdict = False
        at: Any = node
        while isinstance(at, dict) and isinstance(at.get("$ref"), str):
            if id(at) in self._verdicts:  # judged before: so is the rest of the chain
                verdict = self._verdicts[id(at)]
                break
            if id(at) in on_path:
                verdict = True
                break
            path.append(id(at))
            on_path.add(id(at))
            at = _resolve(self.root, at["$ref"])
        for passed in path:  # every node passed leads where this one does
            self._verdicts[passed] = verdict
        return verdict


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local '$ref' ('#', '#/$defs/a') names, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and 0 <= _index(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _index(key: str) -> int:
    """A JSON pointer's array index (ASCII digits only: '²' is a digit to ``isdigit`` but
    not to ``int``), or -1."""
    return int(key) if key.isascii() and key.isdigit() else -1


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
