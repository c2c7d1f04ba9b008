"""Model output -> content and tool calls, whole or as a stream (``--tool-call-parser``).

A parser is fed the output text as it streams (``feed``) and told when it ends
(``finish``); it answers with events: ``Content`` (text for ``delta.content``),
``CallStart`` (a new call: its name) and ``CallArgs`` (a fragment of the newest call's
JSON arguments). Text that may still turn out to open a call is held back, as the
detokenizer holds back a possible stop string.

Formats, named as vLLM names them:
    hermes       Hermes / Qwen2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
                 anywhere in the output, text around them is content.
    llama3_json  Llama 3.1/3.2: the output is ``{"name": ..., "parameters": {...}}`` (after
                 an optional ``<|python_tag|>``), several separated by ``;``.
Two more serve ``tool_choice`` (frontend/api/chat/tools.py), whose output a grammar has shaped:
    RequiredCalls  a JSON array of ``{"name": ..., "parameters": {...}}`` (``required``)
    NamedCall      the arguments object of one given function (a named ``tool_choice``)
Output that does not parse as a call is returned as content, never dropped.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    name: str


@dataclass(frozen=True)
class CallArgs:
    text: str


Event = Content | CallStart | CallArgs


class ToolParser(ABC):
    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events for ``text``, the output's next piece."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for what is still held back; the output has ended."""


def call_events(obj: Any, args_key: str) -> list[Event] | None:
    """``{"name": str, args_key: object | JSON text}`` as events; None if not that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return [CallStart(obj["name"]), CallArgs(text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._held += text
        out: list[Event] = []
        while True:
            tag = self.CLOSE if self._in_call else self.OPEN
            at = self._held.find(tag)
            if at < 0:
                break
            body, self._held = self._held[:at], self._held[at + len(tag) :]
            out += self._call(body) if self._in_call else self._content(body)
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _partial_suffix(self._held, self.OPEN)
            out += self._content(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
        return out

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._in_call:  # an unclosed call: a call if it parses, else text
            events = self._call(held)
            return events if isinstance(events[0], CallStart) else [Content(self.OPEN + held)]
        return self._content(held)

    def _call(self, body: str) -> list[Event]:
        try:
            events = call_events(json.loads(body), "arguments")
        except ValueError:
            events = None
        if events is None:
            return [Content(self.OPEN + body + self.CLOSE)]
        self._calls += 1
        return events

    def _content(self, text: str) -> list[Event]:
        # The whitespace between and after calls is layout, not an answer.
        if not text or (self._calls and not text.strip()):
            return []
        return [Content(text)]


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._text = ""
        self._mode: str | None = None  # "content" or "calls", decided by the first text

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return [Content(text)] if text else []
        self._text += text
        head = self._text.lstrip()
        if self._mode is None and head:
            starts = head.startswith("{") or head.startswith(self.PYTHON_TAG)
            if not starts and not self.PYTHON_TAG.startswith(head):
                self._mode, held, self._text = "content", self._text, ""
                return [Content(held)]
            if starts:
                self._mode = "calls"
        return []  # calls are emitted whole, at the end: several may follow one another

    def finish(self) -> list[Event]:
        text, self._text = self._text, ""
        if self._mode != "calls":
            return [Content(text)] if text else []
        body = text.strip().removeprefix(self.PYTHON_TAG)
        events: list[Event] = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return [Content(text)]
            call = call_events(obj, "parameters") or call_events(obj, "arguments")
            if call is None:
                return [Content(text)]
            events += call
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
        return events


class RequiredCalls(ToolParser):
    """``tool_choice: required``: a grammar made the output a JSON array of calls."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> list[Event]:
        self._text += text
        return []

    def finish(self) -> list[Event]:
        try:
            items = json.loads(self._text)
        except ValueError:
            return [Content(self._text)]  # cut short (max_tokens): not a call
        events: list[Event] = []
        for item in items if isinstance(items, list) else []:
            events += call_events(item, "parameters") or []
        return events or [Content(self._text)]


class NamedCall(ToolParser):
    """A named ``tool_choice``: the output is the call's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self._name: str | None = name

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._name is not None:
            out.append(CallStart(self._name))
            self._name = None
        if text:
            out.append(CallArgs(text))
        return out

    def finish(self) -> list[Event]:
        return self.feed("")


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
