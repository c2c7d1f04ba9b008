"""The per-request incremental detokenizer equals tokenizer.decode, piece by piece."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detokenizer.incremental import TokenTable, WindowedDetokenizer
from tests.detokenizer.helpers import QWEN_IDS, id_lists, mixed_text, oracle

_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def table(qwen_tokenizer: Any) -> TokenTable:
    return TokenTable(qwen_tokenizer)


def _stream(table: TokenTable, ids: list[int], skip: bool) -> list[str]:
    """Pieces emitted token by token, then the end-of-request flush."""
    stream = table.new_stream(skip)
    clamped = table.clamp(np.asarray(ids, dtype=np.int64)).tolist()
    return [stream.feed(i) for i in clamped] + [stream.flush()]


def test_table_is_byte_level_for_qwen(table: TokenTable) -> None:
    assert table.byte_level
    assert table.special_ids == {151643, 151644, 151645}


def test_every_token_text_equals_decoding_it_alone(table: TokenTable, qwen_tokenizer: Any) -> None:
    ids = list(range(QWEN_IDS))
    expected = qwen_tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    assert [table.token_text(i) for i in ids] == expected


@_SETTINGS
@given(ids=id_lists, skip=st.booleans(), spaces=st.booleans())
def test_random_ids_concatenate_to_decode_and_every_step_is_a_prefix(
    table: TokenTable, qwen_tokenizer: Any, ids: list[int], skip: bool, spaces: bool
) -> None:
    final = oracle(qwen_tokenizer, ids, skip, spaces)
    pieces = _stream(table, ids, skip)
    assert "".join(pieces) == final
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert final.startswith(emitted)


@_SETTINGS
@given(text=mixed_text, skip=st.booleans())
def test_text_round_trips_without_replacement_characters(
    table: TokenTable, qwen_tokenizer: Any, text: str, skip: bool
) -> None:
    ids = qwen_tokenizer.encode(text)
    pieces = _stream(table, ids, skip)
    assert "".join(pieces) == oracle(qwen_tokenizer, ids, skip)
    # Split UTF-8 sequences are held back, never rendered as U+FFFD.
    assert not any("\ufffd" in p for p in pieces)


def _byte_token(table: TokenTable, value: int) -> int:
    """The id of the single-byte token for ``value``."""
    return table.bytes_for(False).index(bytes([value]))


def test_split_character_is_held_back_until_complete(table: TokenTable) -> None:
    stream = table.new_stream(True)
    # One character as three single-byte tokens.
    pieces = [stream.feed(_byte_token(table, b)) for b in "中".encode()]
    assert pieces == ["", "", "中"]


def test_stray_continuation_byte_is_emitted_as_decode_renders_it(
    table: TokenTable, qwen_tokenizer: Any
) -> None:
    stream = table.new_stream(True)
    assert stream.feed(_byte_token(table, 0x80)) == "\ufffd"  # can never complete
    ids = [qwen_tokenizer.encode("a")[0], _byte_token(table, 0xE4)]
    stream = table.new_stream(True)
    assert [stream.feed(i) for i in ids] == ["a", ""]  # lone lead byte: may still complete
    assert stream.flush() == "\ufffd" == oracle(qwen_tokenizer, ids, True)[1:]


def test_spaces_between_special_tokens_is_ignored_like_the_fast_tokenizer(
    table: TokenTable, qwen_tokenizer: Any
) -> None:
    ids = [151644, 151645, *qwen_tokenizer.encode("hi"), 151643]
    assert "".join(_stream(table, ids, False)) == "<|im_start|><|im_end|>hi<|endoftext|>"
    assert oracle(qwen_tokenizer, ids, False, spaces=True) == oracle(
        qwen_tokenizer, ids, False, spaces=False
    )


@settings(max_examples=60, deadline=None)
@given(text=mixed_text, skip=st.booleans())
def test_windowed_fallback_matches_decode_on_text(
    qwen_tokenizer: Any, text: str, skip: bool
) -> None:
    ids = qwen_tokenizer.encode(text)
    stream = WindowedDetokenizer(qwen_tokenizer, skip)
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == oracle(qwen_tokenizer, ids, skip)
