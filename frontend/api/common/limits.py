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
import numpy as np

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


# Up to this size a refused value is walked to name the path of its deepest point; past
# it the refusal names the depth alone (a walk costs a second per few MB of containers).
PATH_SEARCH_BYTES = 256 * 1024


def raw_depth(raw: bytes) -> int:
    """How deeply the JSON text ``raw`` nests, as ``json_depth`` counts: brackets outside
    strings, in a few vectorised passes (tens of ms for the largest body), with no walk.
    ``raw`` must be JSON the parser accepted: its strings and escapes are well formed."""
    b = np.frombuffer(raw, np.uint8)
    if not len(b):
        return 0
    quotes = np.flatnonzero(b == 0x22)
    real = quotes
    if len(quotes) and (b[np.maximum(quotes - 1, 0)] == 0x5C).any():  # escaped quotes, maybe
        # Per byte, the index of the last byte at or before it that is not a backslash.
        last_plain = np.where(b == 0x5C, np.int32(-1), np.arange(len(b), dtype=np.int32))
        np.maximum.accumulate(last_plain, out=last_plain)
        before = quotes - 1
        run = np.where(before >= 0, before - last_plain[np.maximum(before, 0)], 0)
        real = quotes[run % 2 == 0]  # a quote after an odd run of backslashes is escaped
    toggles = np.zeros(len(b), np.int8)
    toggles[real] = 1
    inside = (np.cumsum(toggles, dtype=np.int32) & 1).astype(bool)
    step = ((b == 0x5B) | (b == 0x7B)).astype(np.int8) - ((b == 0x5D) | (b == 0x7D))
    step[inside] = 0
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def check_depth(value: Any, limit: int, where: str = "", raw: bytes | None = None) -> None:
    """A 400 if ``value`` (found at path ``where``; the body itself if empty) nests deeper
    than ``limit``. With ``raw``, the JSON text ``value`` was decoded from, it is measured
    there (no walk over a large body unless it is refused)."""
    if raw is not None:
        depth = raw_depth(raw)
        if depth <= limit:
            return
        at = json_depth(value)[1] if len(raw) <= PATH_SEARCH_BYTES else []
    else:
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
    raw = text.encode()
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:
        raise too_deep(limit, param) from None
    except msgspec.DecodeError as e:
        raise ValueError(str(e)) from e
    check_depth(value, limit, param, raw)
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
