"""A chat request's output, read once for every API: reasoning, content, tool calls.

The engine's deltas carry the answer in ``text`` and, with ``--reasoning-parser``, the
reasoning in ``reasoning`` (split by the detokenizer). Tool calls are parsed out of the
answer only, by the parser the request's ``ToolPlan`` names. ``read_answer`` does it for a
whole output (non-streaming responses); ``AnswerEvents`` does it delta by delta, as
events an API writes as its stream (blocks, items, chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.api.chat.tool_parsers import (
    CallArgs,
    CallStart,
    Content,
    Event,
    ToolParser,
)
from frontend.api.chat.tools import ToolPlan, parse_output
from frontend.api.common.call import FINISH_REASONS, Generation
from wire.records import Finish, TextDelta


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text: the model's, kept apart from the answer."""

    text: str


AnswerEvent = Reasoning | Event  # Event: Content, CallStart, CallArgs


def finish_reason(finish: Finish, num_calls: int, plan: ToolPlan) -> str | None:
    """Chat's finish_reason: ``tool_calls`` when calls were made (but ``stop`` for a named
    tool_choice, as OpenAI answers it)."""
    reason = FINISH_REASONS.get(finish)
    if num_calls and reason == "stop" and not plan.named:
        return "tool_calls"
    return reason


@dataclass
class Answer:
    """A whole output, read."""

    reasoning: str
    content: str | None  # None when the output was all tool calls
    tool_calls: list[dict[str, Any]]  # OpenAI's shape: id, type, function {name, arguments}
    finish: Finish
    finish_reason: str | None  # chat's: stop | length | tool_calls | error
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_tokens: int
    reasoning_tokens: int
    error: str | None


def read_answer(gen: Generation, plan: ToolPlan) -> Answer:
    content: str | None = gen.text
    calls: list[dict[str, Any]] = []
    if plan.parser is not None and gen.finish != Finish.ERROR:
        parsed = parse_output(plan.parser(), gen.text)
        content, calls = parsed.content, parsed.tool_calls
    return Answer(
        reasoning=gen.reasoning,
        content=content,
        tool_calls=calls,
        finish=gen.finish,
        finish_reason=finish_reason(gen.finish, len(calls), plan),
        stop_reason=gen.stop_reason,
        num_tokens=len(gen.token_ids),
        reasoning_tokens=gen.reasoning_tokens,
        error=gen.error,
    )


@dataclass
class AnswerEvents:
    """One choice's deltas as events. After the final delta, ``finish_reason`` and the
    counts describe the whole output."""

    plan: ToolPlan
    num_calls: int = 0
    num_tokens: int = 0
    reasoning_tokens: int = 0
    finish: Finish = Finish.NONE
    stop_reason: str | int | None = None
    error: str | None = None
    _parser: ToolParser | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._parser = self.plan.parser() if self.plan.parser is not None else None

    def feed(self, d: TextDelta) -> list[AnswerEvent]:
        self.num_tokens += len(d.token_ids)
        self.reasoning_tokens = d.reasoning_tokens or self.reasoning_tokens
        events: list[AnswerEvent] = [Reasoning(d.reasoning)] if d.reasoning else []
        if self._parser is None:
            events += [Content(d.text)] if d.text else []
        else:
            events += self._parser.feed(d.text)
            if d.finish:
                events += self._parser.finish()
        self.num_calls += sum(isinstance(e, CallStart) for e in events)
        if d.finish:
            self.finish, self.stop_reason, self.error = Finish(d.finish), d.stop_reason, d.error
        return events

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.finish, self.num_calls, self.plan)


__all__ = [
    "Answer",
    "AnswerEvent",
    "AnswerEvents",
    "CallArgs",
    "CallStart",
    "Content",
    "Reasoning",
    "read_answer",
]
