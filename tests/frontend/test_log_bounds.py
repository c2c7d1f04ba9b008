"""What a client controls reaches the log as one short line: cut, control characters
escaped, unknown fields counted with a few names."""

from __future__ import annotations

from frontend.http.log_bounds import MAX_LINE, SHOWN_NAMES, clip, ignored_fields


def test_clip_keeps_short_text_and_cuts_long_text_saying_how_long_it_was() -> None:
    assert clip("model 'x' not found") == "model 'x' not found"
    long = clip("y" * 6_000_000)
    assert len(long) == MAX_LINE and long.endswith("... (6000000 characters)")
    assert long.startswith("y" * 100)


def test_clip_escapes_what_could_forge_a_log_line() -> None:
    assert clip("a\nINFO forged\r\x1b[31m") == "a\\nINFO forged\\r\\x1b[31m"
    escaped = clip("\n" * 5000)  # escaping doubles it: still one line of MAX_LINE
    assert len(escaped) == MAX_LINE and "\n" not in escaped


def test_unknown_fields_are_a_count_and_a_few_names_in_one_line() -> None:
    names = [f"f{i:06d}" for i in range(400_000)]
    line = ignored_fields("/v1/messages", names)
    assert line == (
        "/v1/messages: ignoring 400000 unknown fields: "
        "f000000, f000001, f000002, f000003, f000004 and 399995 more"
    )
    assert SHOWN_NAMES == 5
    huge = ignored_fields("/v1/responses", ["n" * 1_000_000, "o\nk"] * 4)
    assert len(huge) <= MAX_LINE and "\n" not in huge
    assert ignored_fields("/v1/chat/completions", ["stream2"]) == (
        "/v1/chat/completions: ignoring 1 unknown field: stream2"
    )
