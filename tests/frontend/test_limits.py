"""What one request may cost (frontend/api/common/limits.py): depth without recursion, sizes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.api.common.limits import (
    check_depth,
    check_size,
    decode_json_text,
    json_depth,
    raw_depth,
)
from frontend.errors import LimitExceeded


def nest(depth: int) -> object:
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize(
    ("value", "depth", "at"),
    [
        (1, 0, []),
        ("s", 0, []),
        (None, 0, []),
        ({}, 1, []),
        ([], 1, []),
        ([[1]], 2, [0]),
        ({"a": 1, "b": {"c": [2]}}, 3, ["b", "c"]),
    ],
)
def test_json_depth_and_where_it_is_deepest(value: object, depth: int, at: list[object]) -> None:
    assert json_depth(value) == (depth, at)


def test_depth_far_past_the_recursion_limit_is_measured() -> None:
    assert json_depth(nest(100_000))[0] == 100_000


def test_too_deep_names_the_path_the_limit_and_the_value() -> None:
    body = {"messages": [{"content": nest(70)}]}
    with pytest.raises(LimitExceeded) as info:
        check_depth(body, 64)
    assert info.value.limit == "max_json_depth"
    assert info.value.param is not None and info.value.param.startswith(
        "messages[0].content[0].k[0]"
    )
    assert (
        "nested 73 levels deep" in info.value.message and "--max-json-depth" in info.value.message
    )
    check_depth(body, 73)  # at the limit: fine


@pytest.mark.parametrize("depth", [65, 2_000, 50_000])
def test_deep_json_text_is_refused_by_depth(depth: int) -> None:
    with pytest.raises(LimitExceeded) as info:
        decode_json_text("[" * depth + "]" * depth, 64, "x.arguments")
    assert info.value.limit == "max_json_depth" and info.value.param is not None
    assert info.value.param.startswith("x.arguments")


def test_json_text_that_is_not_json_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        decode_json_text("{oops", 64, "x")
    assert decode_json_text('{"a": [1]}', 64, "x") == {"a": [1]}


def test_size_is_compact_json_bytes() -> None:
    assert check_size([{"a": "é"}], 100, "max_tools_bytes", "tools") == len('[{"a":"é"}]'.encode())
    with pytest.raises(LimitExceeded) as info:
        check_size(["x" * 100], 50, "max_tools_bytes", "tools")
    assert info.value.limit == "max_tools_bytes" and "104 bytes" in info.value.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='k"\\[]}', max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, database=None)
@given(value=json_values, compact=st.booleans())
def test_raw_depth_agrees_with_the_walk(value: object, compact: bool) -> None:
    """Brackets, quotes and backslashes inside strings never count; escapes of any run."""
    text = json.dumps(value, separators=(",", ":") if compact else None)
    assert raw_depth(text.encode()) == json_depth(value)[0]
