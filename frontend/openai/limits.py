"""What one request may cost before any work is spent on it: the nesting depth of any
JSON value in it, the size of its tools and of its output schema.

Why: tool schemas and arguments come from whatever an agent was given. A value nested
thousands of levels deep overflows every recursive walk after the parser (templates,
``json``, schema checks); a large or deep schema can take minutes to compile into a
grammar. Each check is linear in the request's size and never recursive, and a request
over a limit gets a ``LimitExceeded`` (400 naming the limit, its flag and the value).
The grammar compile's own wall-clock budget is ``frontend/engine_link/grammar_pool.py``'s.

The limits, their ``launch`` flags and defaults are ``FrontendSettings``' fields
``max_json_depth``, ``max_tools_bytes``, ``max_schema_bytes`` and
``grammar_compile_timeout_s``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from frontend.errors import LimitExceeded, field_path


def json_depth(value: Any) -> tuple[int, list[str | int]]:
    """How deeply ``value`` nests (a scalar 0, ``[]`` 1, ``[[1]]`` 2), and the path to
    its deepest container. Iterative: no depth overflows it."""
    if not isinstance(value, dict | list):
        return 0, []
    deepest, at = 0, []
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > deepest:
            deepest, at = depth, list(path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, (*path, key)))
    return deepest, at


def check_depth(value: Any, limit: int, where: str = "") -> None:
    """A 400 if ``value`` (found at path ``where``; the body itself if empty) nests deeper
    than ``limit``."""
    depth, at = json_depth(value)
    if depth > limit:
        path = field_path([where, *at] if where else at) or "the request body"
        raise LimitExceeded(
            "max_json_depth",
            limit,
            f"'{path}' is nested {depth} levels deep",
            param=field_path([where, *at]) or None,
        )


def too_deep(limit: int, param: str | None = None) -> LimitExceeded:
    """The refusal of JSON the parser itself found too deep to decode (about 1000 levels)."""
    what = f"the JSON of '{param}' is" if param else "the request body's JSON is"
    return LimitExceeded(
        "max_json_depth", limit, f"{what} nested over 999 levels deep", param=param
    )


def decode_json_text(text: str, limit: int, param: str) -> Any:
    """JSON text inside a request (tool call arguments, a schema given as a string),
    decoded and depth-checked; ``ValueError`` if it is not JSON."""
    try:
        value = msgspec.json.decode(text.encode())
    except RecursionError:
        raise too_deep(limit, param) from None
    except msgspec.DecodeError as e:
        raise ValueError(str(e)) from e
    check_depth(value, limit, param)
    return value


def check_size(value: Any, limit: int, name: str, param: str) -> int:
    """A 400 if ``value`` as compact JSON is more than ``limit`` bytes; its size if not."""
    size = len(msgspec.json.encode(value))
    if size > limit:
        raise LimitExceeded(name, limit, f"'{param}' is {size} bytes", param=param)
    return size


def check_text_size(text: str, limit: int, name: str, what: str, param: str) -> None:
    """A 400 if ``text`` (UTF-8) is more than ``limit`` bytes."""
    size = len(text.encode())
    if size > limit:
        raise LimitExceeded(name, limit, f"{what} is {size} bytes", param=param)
