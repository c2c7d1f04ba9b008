"""The <think>…</think> split: the same reasoning and answer however the text is cut."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detokenizer.reasoning import ReasoningSplitter
from detokenizer.shard import DetokShard
from tests.detokenizer.helpers import collect, register, stream_batches
from wire.params import DetokParams, ReasoningMode
from wire.records import Finish


def split_oracle(text: str, mode: ReasoningMode) -> tuple[str, str]:
    """(reasoning, answer) of a whole output, as the module docstring defines them."""
    if mode == ReasoningMode.AT_START:
        head = text.lstrip()
        if not head.startswith("<think>"):
            return "", text
        text = head[len("<think>") :]
    at = text.find("</think>")
    if at < 0:
        return text.lstrip(), ""
    return text[:at].strip(), text[at + len("</think>") :].lstrip()


def run(chunks: list[str], mode: ReasoningMode) -> tuple[str, str]:
    splitter = ReasoningSplitter(mode)
    reasoning = answer = ""
    for chunk in chunks:
        r, a = splitter.feed(chunk)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.flush()
    return reasoning + r, answer + a


def cuts(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("mode", [ReasoningMode.AT_START, ReasoningMode.OPEN])
def test_a_closing_tag_cut_at_every_point_is_found(mode: ReasoningMode) -> None:
    text = ("<think>" if mode == ReasoningMode.AT_START else "") + "\nI add 2 and 2.\n</think>\n\n4"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run([text[:i], text[i:j], text[j:]], mode) == ("I add 2 and 2.", "4"), (i, j)


def test_an_output_that_does_not_open_the_block_is_all_answer() -> None:
    assert run([" Hello", " <think>x</think>"], ReasoningMode.AT_START) == (
        "",
        " Hello <think>x</think>",
    )
    assert run(["<thi", "nk it over"], ReasoningMode.AT_START) == ("", "<think it over")
    assert run(["  <th"], ReasoningMode.AT_START) == ("", "  <th")


def test_reasoning_cut_short_keeps_its_partial_tag() -> None:
    assert run(["<think>abc </th"], ReasoningMode.AT_START) == ("abc </th", "")
    assert run(["abc"], ReasoningMode.OPEN) == ("abc", "")


def test_only_text_that_may_be_a_tag_or_layout_is_held_back() -> None:
    s = ReasoningSplitter(ReasoningMode.OPEN)
    assert s.feed("step one") == ("step one", "")
    assert s.feed(" </") == ("", "")  # " " may precede the tag, "</" may begin it
    assert s.feed("b>") == (" </b>", "")
    assert s.feed("</think>\n") == ("", "")
    assert s.feed("\nOK") == ("", "OK")
    assert s.feed(" <think>") == ("", " <think>")  # the block opens only at the start


texts = st.text(alphabet=st.sampled_from(list("ab \n<>/thinkTHINK</think><think>")), max_size=40)


@settings(max_examples=400, deadline=None)
@given(
    body=texts,
    opened=st.booleans(),
    points=st.lists(st.integers(0, 100), max_size=6),
)
def test_any_cut_gives_the_whole_text_split(body: str, opened: bool, points: list[int]) -> None:
    mode = ReasoningMode.OPEN if opened else ReasoningMode.AT_START
    assert run(cuts(body, points), mode) == split_oracle(body, mode)


def test_the_shard_splits_a_closing_tag_spread_over_tokens(qwen_tokenizer: Any) -> None:
    text = "<think>\nLet me see.\n</think>\n\nParis."
    ids = qwen_tokenizer.encode(text)
    pieces = [qwen_tokenizer.decode([i]) for i in ids]
    assert "</think>" not in pieces  # the tag really is cut across tokens
    shard, out = DetokShard(qwen_tokenizer), {}
    shard.register(register(1, DetokParams(reasoning=ReasoningMode.AT_START, stop=("Paris",))))
    for batch in stream_batches(1, ids, Finish.STOP):
        shard.on_tokens(batch, 0)
        collect(shard, out)
    deltas = out[1]
    assert "".join(d.reasoning for d in deltas) == "Let me see."
    # The stop string sees only the answer: it matched there, not in the reasoning.
    assert "".join(d.text for d in deltas) == ""
    assert deltas[-1].finish == Finish.STOP and deltas[-1].stop_reason == "Paris"
    # Reasoning tokens: through the one that completes the closing tag.
    closed = next(k for k in range(len(ids)) if "</think>" in qwen_tokenizer.decode(ids[:k]))
    assert deltas[-1].reasoning_tokens == closed


def test_a_stop_string_inside_the_reasoning_does_not_stop(qwen_tokenizer: Any) -> None:
    ids = qwen_tokenizer.encode("<think>wait, STOP here?</think>Yes.")
    shard, out = DetokShard(qwen_tokenizer), {}
    shard.register(register(2, DetokParams(reasoning=ReasoningMode.AT_START, stop=("STOP",))))
    for batch in stream_batches(2, ids):
        shard.on_tokens(batch, 0)
        collect(shard, out)
    assert "".join(d.reasoning for d in out[2]) == "wait, STOP here?"
    assert "".join(d.text for d in out[2]) == "Yes."
    assert out[2][-1].finish == Finish.LENGTH


def test_a_replayed_request_keeps_its_place_in_the_block(qwen_tokenizer: Any) -> None:
    """A request re-registered after a shard restart resumes inside or after the block."""
    ids = qwen_tokenizer.encode("<think>abc def</think>ghi jkl")
    whole: dict[int, list[Any]] = {}
    shard = DetokShard(qwen_tokenizer)
    params = DetokParams(reasoning=ReasoningMode.AT_START)
    shard.register(register(3, params))
    for batch in stream_batches(3, ids):
        shard.on_tokens(batch, 0)
    collect(shard, whole)
    for cut in range(1, len(ids)):
        first: dict[int, list[Any]] = {}
        a = DetokShard(qwen_tokenizer, table=shard.table)
        a.register(register(4, params))
        for batch in stream_batches(4, ids)[:cut]:
            a.on_tokens(batch, 0)
        collect(a, first)
        b, second = DetokShard(qwen_tokenizer, table=shard.table), {}  # type: ignore[var-annotated]
        b.register(register(5, params, output_ids=ids[:cut]))
        for pos, batch in enumerate(stream_batches(5, ids)[cut:], start=cut):
            assert int(batch.positions[0]) == pos
            b.on_tokens(batch, 0)
        collect(b, second)
        got = first.get(4, []) + second.get(5, [])
        assert "".join(d.reasoning for d in got) == "abc def", cut
        assert "".join(d.text for d in got) == "ghi jkl", cut
