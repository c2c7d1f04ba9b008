"""The flags of what one request may cost (docs/reliability.md; ``frontend/api/common/limits.py``),
kept apart from ``launcher/args.py``'s long table: their defaults are
``FrontendSettings``', and ``validate_request_limits`` says which flag to change."""

from __future__ import annotations

import argparse
from typing import Any, Protocol

from frontend.settings import MAX_GRAMMAR_BYTES, FrontendSettings

_D = FrontendSettings(model_name="", max_model_len=2, vocab_size=1)
# Deeper than this, the recursive walks after the parser (templates, schema checks) could
# overflow Python's stack: the flag cannot raise the limit past it.
MAX_JSON_DEPTH = 256


class RequestLimits(Protocol):
    """The limits' fields of ``ServerConfig`` (read only)."""

    @property
    def max_json_depth(self) -> int: ...
    @property
    def max_tools_bytes(self) -> int: ...
    @property
    def max_schema_bytes(self) -> int: ...
    @property
    def grammar_compile_timeout(self) -> float: ...
    @property
    def grammar_workers(self) -> int: ...


DEFAULTS: dict[str, Any] = {
    "max_json_depth": _D.max_json_depth,
    "max_tools_bytes": _D.max_tools_bytes,
    "max_schema_bytes": _D.max_schema_bytes,
    "grammar_compile_timeout": _D.grammar_compile_timeout_s,
    "grammar_workers": _D.grammar_workers,
}


def add_request_limit_flags(p: argparse._ActionsContainer) -> None:
    add = p.add_argument
    add(
        "--max-json-depth",
        type=int,
        default=_D.max_json_depth,
        help="deepest nesting of any JSON value in a request (the body, tool call "
        f"arguments, schemas; at most {MAX_JSON_DEPTH}); deeper: 400",
    )
    add(
        "--max-tools-bytes",
        type=int,
        default=_D.max_tools_bytes,
        help="largest 'tools' of a request, as compact JSON; larger: 400",
    )
    add(
        "--max-schema-bytes",
        type=int,
        default=_D.max_schema_bytes,
        help="largest output constraint (a response-format schema, regex or grammar, or "
        f"the schema a forced tool choice makes; at most {MAX_GRAMMAR_BYTES}); larger: 400",
    )
    add(
        "--grammar-compile-timeout",
        type=float,
        default=_D.grammar_compile_timeout_s,
        help="seconds one grammar may take to compile; its compile is then abandoned "
        "(its process killed) and the request answered 400",
    )
    add(
        "--grammar-workers",
        type=int,
        default=_D.grammar_workers,
        help="processes per frontend that compile grammars at once (started as needed)",
    )


def validate_request_limits(c: RequestLimits) -> str | None:
    """What is wrong with the limits, naming the flag; None if nothing."""
    if not 1 <= c.max_json_depth <= MAX_JSON_DEPTH:
        return f"--max-json-depth must be in [1, {MAX_JSON_DEPTH}], got {c.max_json_depth}"
    if c.max_tools_bytes < 1:
        return f"--max-tools-bytes must be >= 1, got {c.max_tools_bytes}"
    if not 1 <= c.max_schema_bytes <= MAX_GRAMMAR_BYTES:
        return f"--max-schema-bytes must be in [1, {MAX_GRAMMAR_BYTES}], got {c.max_schema_bytes}"
    if not c.grammar_compile_timeout > 0:
        return f"--grammar-compile-timeout must be > 0 seconds, got {c.grammar_compile_timeout}"
    if c.grammar_workers < 1:
        return f"--grammar-workers must be >= 1, got {c.grammar_workers}"
    return None
