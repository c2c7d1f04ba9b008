"""Stop-string matching over a request's text stream, with minimal hold-back.

Semantics (independent of how the text is cut into pieces): reading the final text one
character at a time, the request stops at the first position where some stop string has
just been completed; if several complete there, the longest (earliest-starting) wins.
The output is the text before that occurrence, or through it with
``include_stop_str_in_output``.

Invariant: ``_held`` never contains a whole stop string, and it is exactly the longest
suffix of the text seen so far that is a proper prefix of some stop string. Only that
suffix is held back: everything before it can never become part of a match.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    stop: str  # the stop string that matched
    text: str  # the text to release before finishing (stop string removed or kept)


class StopMatcher:
    __slots__ = ("_held", "_include", "_stops")

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool) -> None:
        # An empty stop string would match before any output; it means nothing useful.
        self._stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._include = include_stop_str_in_output
        self._held = ""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> tuple[str, StopMatch | None]:
        """Take new stream text; return the text now safe to release, and a match if any."""
        if not text:
            return "", None
        window = self._held + text
        match = self._first_match(window)
        if match is not None:
            self._held = ""
            return "", match
        keep = self._partial_len(window)
        self._held = window[len(window) - keep :] if keep else ""
        return window[: len(window) - keep], None

    def flush(self) -> str:
        """The stream has ended without a match: release what was held back."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, window: str) -> StopMatch | None:
        # (end, start) orders matches by completion, then longest (earliest start) first.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, start, stop = best
        cut = end if self._include else start
        return StopMatch(stop=stop, text=window[:cut])

    def _partial_len(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(window)), longest, -1):
                if window.endswith(stop[:k]):
                    longest = k
                    break
        return longest
