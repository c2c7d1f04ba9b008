"""Structured output: a request's constraint fields -> one ``GrammarSpec``, validated.

Accepted spellings (OpenAI's, then vLLM's current and older ones); at most one per request:
    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema":
                      {"name": ..., "schema": {...}, "strict": ...}} | {"type": "text"}
    structured_outputs {"json": schema | JSON text} | {"regex": str} | {"choice": [str]}
                      | {"grammar": EBNF} | {"json_object": true}
    guided_json, guided_regex, guided_choice, guided_grammar

The spec is compiled once here, in one of the frontend's grammar worker processes
(``frontend/engine_link/grammar_pool.py``) within the compile budget, so a schema the
grammar engine rejects, one using a keyword it would silently not enforce, or one that
would take too long, is a 400 that says what is wrong before any worker sees the
request. Workers compile it again for themselves (engine/sampling/grammar.py); both
sides cache by the spec's key. Sizes and depths are checked first (``limits.py``). A
grammar that admits no output is a 400 too: a JSON schema that says so on its face
(``schema_checks.py``), or one whose compiled grammar does (engine/sampling/grammar_check.py).
"""

from __future__ import annotations

import json
from typing import Any

from engine.sampling.grammar import GrammarError
from frontend.api.common.limits import check_text_size, decode_json_text
from frontend.api.common.schema_checks import check_satisfiable
from frontend.engine_link.grammar_pool import GrammarPool, GrammarTimeout, GrammarUnavailable
from frontend.errors import (
    InvalidRequest,
    LimitExceeded,
    NotImplementedField,
    ServiceUnavailable,
)
from frontend.settings import FrontendSettings
from wire.params import GrammarKind, GrammarSpec

MAX_CHOICES = 1024
# JSON-schema keywords xgrammar accepts but does not enforce (checked against 0.2.8):
# an output "valid" under them could violate the schema, so they are refused instead.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "dependentSchemas")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "contains")


def grammar_spec(body: Any, max_depth: int = 64) -> tuple[str, GrammarSpec] | None:
    """(the field, its spec) of the one constraint ``body`` asks for, or None; 400 if
    several. A schema given as JSON text may nest ``max_depth`` levels."""
    found: list[tuple[str, GrammarSpec]] = []
    if body.response_format is not None:
        spec = _from_response_format(body.response_format, max_depth)
        if spec is not None:
            found.append(("response_format", spec))
    if body.structured_outputs is not None:
        found += _from_structured_outputs(body.structured_outputs, max_depth)
    legacy = {
        "guided_json": body.guided_json,
        "guided_regex": body.guided_regex,
        "guided_choice": body.guided_choice,
        "guided_grammar": body.guided_grammar,
    }
    for name, value in legacy.items():
        if value is not None:
            found.append((name, _spec(name.removeprefix("guided_"), value, name, max_depth)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequest(
            f"give one output constraint, not several ({names})", param=found[1][0]
        )
    return found[0] if found else None


def _from_response_format(fmt: dict[str, Any], max_depth: int) -> GrammarSpec | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec(kind=GrammarKind.JSON_OBJECT)
    if kind != "json_schema":
        raise InvalidRequest(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
            param="response_format.type",
        )
    inner = fmt.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise InvalidRequest(
            "response_format json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return _spec("json", inner["schema"], "response_format.json_schema.schema", max_depth)


def _from_structured_outputs(so: dict[str, Any], max_depth: int) -> list[tuple[str, GrammarSpec]]:
    out = []
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if value is None or (key == "json_object" and value is False):
            continue
        if key in ("json", "regex", "choice", "grammar"):
            out.append((param, _spec(key, value, param, max_depth)))
        elif key == "json_object":
            out.append((param, GrammarSpec(kind=GrammarKind.JSON_OBJECT)))
        else:
            raise NotImplementedField(
                param,
                "only json, regex, choice, grammar and json_object constraints are implemented",
            )
    return out


def _spec(key: str, value: Any, param: str, max_depth: int) -> GrammarSpec:
    """One vLLM-style constraint (``json``/``regex``/``choice``/``grammar``) as a spec."""
    if key == "json":
        schema = _schema(value, param, max_depth)
        check_satisfiable(schema, param)
        check_enforceable(schema, param)
        return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(schema))
    if key == "choice":
        ok = isinstance(value, list) and value and all(isinstance(c, str) for c in value)
        if not ok or len(value) > MAX_CHOICES:
            raise InvalidRequest(
                f"{param} must be a list of 1 to {MAX_CHOICES} strings", param=param
            )
        return GrammarSpec(kind=GrammarKind.CHOICE, text=json.dumps(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param=param)
    kind = GrammarKind.REGEX if key == "regex" else GrammarKind.EBNF
    return GrammarSpec(kind=kind, text=value)


def _schema(value: Any, param: str, max_depth: int) -> Any:
    if isinstance(value, str):
        try:
            value = decode_json_text(value, max_depth, param)
        except ValueError as e:
            raise InvalidRequest(f"{param} is not valid JSON: {e}", param=param) from e
    if not isinstance(value, dict | bool):
        raise InvalidRequest(f"{param} must be a JSON schema (an object)", param=param)
    return value


def check_enforceable(schema: Any, param: str) -> None:
    """Refuse keywords the grammar engine would ignore, and references it cannot follow."""
    if not isinstance(schema, dict):
        return
    for word in UNENFORCED_KEYWORDS:
        if word in schema:
            raise NotImplementedField(
                param, f"the JSON-schema keyword '{word}' is not enforced by the grammar engine"
            )
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        # NOTE: xgrammar 0.2.8 drops such an allOf and every keyword beside it.
        raise NotImplementedField(
            param, "an 'allOf' of several schemas is not enforced by the grammar engine"
        )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise NotImplementedField(param, f"only local $ref ('#/...') is supported, not {ref!r}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                check_enforceable(sub, param)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                check_enforceable(sub, param)
    for key in _SUBSCHEMAS:
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else [subs]:
            check_enforceable(sub, param)


async def checked_grammar(
    grammars: GrammarPool, body: Any, settings: FrontendSettings
) -> GrammarSpec | None:
    """``body``'s constraint, compiled once in a grammar worker (cached by key); 400 if it
    is over a limit or does not compile within the budget."""
    found = grammar_spec(body, settings.max_json_depth)
    if found is None:
        return None
    param, spec = found
    await compile_checked(grammars, spec, param, settings)
    return spec


async def compile_checked(
    grammars: GrammarPool, spec: GrammarSpec, param: str, settings: FrontendSettings
) -> None:
    """Check ``spec``'s size, then compile it in a grammar worker (cached by key); a 400
    naming ``param`` if it is too big, does not compile, or outlasts the budget; a 503 if
    no grammar worker can start."""
    check_text_size(
        spec.text,
        settings.max_schema_bytes,
        "max_schema_bytes",
        f"the output constraint of '{param}'",
        param,
    )
    try:
        await grammars.check(spec)
    except GrammarError as e:
        raise InvalidRequest(str(e), param=param) from e
    except GrammarTimeout as e:
        raise LimitExceeded(
            "grammar_compile_timeout",
            settings.grammar_compile_timeout_s,
            f"the grammar of '{param}' {e} and was abandoned",
            param=param,
        ) from e
    except GrammarUnavailable as e:  # the server's fault: the next request tries afresh
        raise ServiceUnavailable(
            1.0, f"'{param}' cannot be checked now: {e}", code="grammar_unavailable"
        ) from e
