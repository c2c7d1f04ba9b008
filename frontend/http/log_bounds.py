"""What one request may write to the log: a few short lines, never its body.

A probe found a 6.75 MB body of unknown fields writing about 6 MB to the log: every name
went into one line. Any text a client controls (field names, an error message that quotes
its input) goes through ``clip`` before it is logged: at most ``MAX_LINE`` characters,
control characters escaped (a newline in a field name must not forge a second log line).
Unknown or ignored fields are logged as one line per request: their count and the first
``SHOWN_NAMES`` names (``ignored_fields``). With at most one such line, one refusal line
and one error line a request, no request writes more than about 1 kB to the log. A
handler's own bug logs its traceback (``bounded_traceback``): its last ``TRACEBACK_LINES``
lines (the innermost frames and the message), each clipped, at most about 4 kB.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence

MAX_LINE = 200  # characters of client-controlled text in one log line
SHOWN_NAMES = 5  # unknown field names a line names; the rest are counted
_NAME = 40  # characters of one field name shown
TRACEBACK_LINES = 20  # lines of an unhandled error's traceback logged, the last ones


def clip(text: str, limit: int = MAX_LINE) -> str:
    """``text`` as one line of at most ``limit`` printable characters; a longer one is cut
    and says how long it was."""
    head = text[:limit]
    if not head.isprintable():
        head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)
    if len(text) <= limit and len(head) <= limit:
        return head
    suffix = f"... ({len(text)} characters)"
    return head[: max(0, limit - len(suffix))] + suffix


def ignored_fields(path: str, names: Sequence[str]) -> str:
    """The one log line of a request's unknown fields: how many, and the first few."""
    shown = ", ".join(clip(n, _NAME) for n in names[:SHOWN_NAMES])
    more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    noun = "field" if len(names) == 1 else "fields"
    return clip(f"{path}: ignoring {len(names)} unknown {noun}: {shown}{more}")


def bounded_traceback(error: BaseException) -> str:
    """``error``'s traceback as a log line's continuation: its last ``TRACEBACK_LINES``
    lines, each clipped (an exception's message may quote a client's input)."""
    lines = "".join(traceback.format_exception(error)).splitlines()
    kept = [clip(line) for line in lines[-TRACEBACK_LINES:]]
    cut = len(lines) - len(kept)
    return "\n".join(([f"... ({cut} lines before)"] if cut > 0 else []) + kept)
