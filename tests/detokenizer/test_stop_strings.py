"""Stop strings end the text at their first occurrence, hold back only partial matches."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from detokenizer.stop_strings import StopMatcher
from tests.detokenizer.helpers import stop_oracle


def _run(
    chunks: list[str], stops: tuple[str, ...], include: bool, check_held: bool = False
) -> tuple[str, str | None]:
    """Feed ``chunks`` to a matcher: the text it released (up to and with the stop, if one
    matched) and the stop. ``check_held``: after each chunk that matched nothing, the
    matcher holds back exactly the shortest tail that could still begin a stop."""
    matcher = StopMatcher(stops, include)
    out = seen = ""
    for chunk in chunks:
        released, match = matcher.feed(chunk)
        out += released
        seen += chunk
        if match is not None:
            return out + match.text, match.stop
        if check_held:
            assert matcher.held == _min_held(seen, tuple(s for s in stops if s))
    return out + matcher.flush(), None


def test_stop_spanning_chunks_is_removed() -> None:
    assert _run(["Hel", "lo wo", "rld"], ("o w",), False) == ("Hell", "o w")
    assert _run(["Hel", "lo wo", "rld"], ("o w",), True) == ("Hello w", "o w")


def test_failed_partial_match_releases_the_held_text() -> None:
    matcher = StopMatcher(("abc",), False)
    assert matcher.feed("xab") == ("x", None)
    assert matcher.held == "ab"
    assert matcher.feed("d") == ("abd", None)
    assert matcher.held == ""


def test_overlapping_partial_match_still_finds_the_stop() -> None:
    # "aab" fails as a match of "aabx"... at offset 0 but is one at offset 1.
    assert _run(["a", "a", "a", "b", "x", "tail"], ("aabx",), False) == ("a", "aabx")


def test_stop_at_very_start_and_very_end() -> None:
    assert _run(["STOP", "more"], ("STOP",), False) == ("", "STOP")
    assert _run(["text ", "END"], ("END",), False) == ("text ", "END")
    assert _run(["text ", "END"], ("END",), True) == ("text END", "END")


def test_first_completed_stop_wins_over_earlier_started_one() -> None:
    # "bc" completes at 3, before "abcd" would at 4.
    assert _run(["abcd"], ("abcd", "bc"), False) == ("a", "bc")
    # Both complete at the same character: the longer, earlier-starting one wins.
    assert _run(["xabc"], ("bc", "abc"), False) == ("x", "abc")


def test_text_that_cannot_start_a_stop_is_not_held() -> None:
    matcher = StopMatcher(("</answer>",), False)
    assert matcher.feed("the answer is 4") == ("the answer is 4", None)
    assert matcher.feed(" </ans") == (" ", None)


def _min_held(text: str, stops: tuple[str, ...]) -> str:
    for k in range(len(text), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return text[-k:]
    return ""


_letters = st.text(alphabet="abc😀", max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="abc😀 ", max_size=6), max_size=12),
    stops=st.lists(_letters, min_size=1, max_size=3).map(tuple),
    include=st.booleans(),
)
def test_matcher_equals_the_whole_text_oracle_and_holds_back_minimally(
    chunks: list[str], stops: tuple[str, ...], include: bool
) -> None:
    want = stop_oracle("".join(chunks), stops, include)
    assert _run(chunks, stops, include, check_held=True) == want
