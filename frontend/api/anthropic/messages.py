"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

The body becomes the internal chat request (``messages_request.to_chat``) and runs as a
chat completion does (``chat_run.start_chat``); the output, read by ``answer.py``, is
written as Anthropic's content blocks: ``thinking`` (the reasoning, with
``--reasoning-parser``), ``text`` and ``tool_use``. Streamed, as its event sequence:

    message_start                      the message, empty, with the prompt's usage
    content_block_start                a block opens (index 0, 1, ...)
    content_block_delta                thinking_delta | text_delta | input_json_delta
    content_block_stop                 it closes (before the next one opens)
    message_delta                      stop_reason, stop_sequence, the final usage
    message_stop
    ping                               whenever PING_S passes with nothing else to send

``usage.input_tokens`` counts the prompt tokens computed for this request and
``cache_read_input_tokens`` the ones the prefix cache supplied (Anthropic's split: their
sum is the prompt). Errors, streamed or not, are Anthropic's shape (``frontend/errors.py``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.api.anthropic.messages_request import CountTokensRequest, MessagesRequest, to_chat
from frontend.api.chat.answer import (
    Answer,
    AnswerEvents,
    CallArgs,
    CallStart,
    Content,
    Reasoning,
    read_answer,
)
from frontend.api.chat.run import ChatRun, chat_prompt_ids, start_translated
from frontend.api.chat.tools import plan_tools
from frontend.api.common.call import collect_all
from frontend.api.common.context import ServingContext, check_model
from frontend.api.common.sse import typed_sse_stream, with_keepalive
from frontend.errors import APIError, EngineFailed, InternalError
from wire.records import Finish

PING_S = 10.0  # a quiet stream gets a ping this often (a queued or slowly compiling request)


async def count_tokens(
    ctx: ServingContext, request: Request, body: CountTokensRequest, arrival: float
) -> Response:
    """The prompt's length in tokens, exactly as ``/v1/messages`` would render it."""
    check_model(ctx, body.model)
    chat = to_chat(body)
    # The tools as the template renders them, whatever the choice (and whether or not the
    # server could parse calls: counting needs no parser).
    plan = plan_tools(chat.model_copy(update={"tool_choice": "none"}), None)
    ids = await asyncio.to_thread(chat_prompt_ids, ctx, chat, plan.template_tools)
    return JSONResponse({"input_tokens": len(ids)})


async def create_message(
    ctx: ServingContext, request: Request, body: MessagesRequest, arrival: float
) -> Response:
    run = await start_translated(ctx, request, body, to_chat, arrival)
    head = {
        "id": f"msg_{run.rid:x}{secrets.token_hex(4)}",
        "type": "message",
        "role": "assistant",
        "model": ctx.settings.model_name,
    }
    if body.stream:
        events = _stream(run, head)
        return StreamingResponse(
            typed_sse_stream(events, run.rid, _error_event), media_type="text/event-stream"
        )
    (gen,) = await collect_all(run.calls, request)
    answer = read_answer(gen, run.plan)
    if answer.finish == Finish.ERROR:
        raise EngineFailed(answer.error)
    reason, sequence = _stop_reason(answer.finish, answer.stop_reason, bool(answer.tool_calls))
    return JSONResponse(
        {
            **head,
            "content": _blocks(answer),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(run, answer.num_tokens),
        }
    )


def _blocks(answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if isinstance(args, dict):
            blocks.append(
                {"type": "tool_use", "id": _tool_use_id(), "name": fn["name"], "input": args}
            )
        else:  # cut short by max_tokens: what was written, as text, rather than nothing
            blocks.append({"type": "text", "text": fn["arguments"]})
    return blocks


def _tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def _stop_reason(
    finish: Finish, stop_reason: str | int | None, called: bool
) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an output that ended as ``finish``."""
    if finish == Finish.LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if finish == Finish.STOP and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(run: ChatRun, output_tokens: int) -> dict[str, int]:
    cached = run.cached_tokens or 0
    return {
        "input_tokens": len(run.prompt_ids) - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _error_event(err: APIError) -> dict[str, Any]:
    return err.anthropic_body()


@dataclass
class _Blocks:
    """The streamed content blocks: which one is open, and the events that move on."""

    index: int = -1
    open: str | None = None  # the open block's type
    events: list[dict[str, Any]] = field(default_factory=list)

    def to(self, kind: str, start: dict[str, Any] | None = None) -> None:
        """Make a block of ``kind`` the open one (a new one if ``start`` is given)."""
        if self.open == kind and start is None:
            return
        self.close()
        self.index, self.open = self.index + 1, kind
        block = start or {"type": kind, kind: ""}
        if kind == "thinking":
            block = {**block, "signature": ""}
        self.events.append(
            {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def delta(self, kind: str, **fields: Any) -> None:
        self.events.append(
            {"type": "content_block_delta", "index": self.index, "delta": {"type": kind, **fields}}
        )

    def close(self) -> None:
        if self.open is not None:
            self.events.append({"type": "content_block_stop", "index": self.index})
            self.open = None

    def take(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


async def _stream(run: ChatRun, head: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    usage = _usage(run, 0)
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield {"type": "message_start", "message": message}
    reader, blocks = AnswerEvents(run.plan), _Blocks()
    async for d in with_keepalive(run.calls[0].deltas(), PING_S):
        if d is None:
            yield {"type": "ping"}
            continue
        for event in reader.feed(d):
            if isinstance(event, Reasoning):
                blocks.to("thinking")
                blocks.delta("thinking_delta", thinking=event.text)
            elif isinstance(event, Content):
                blocks.to("text")
                blocks.delta("text_delta", text=event.text)
            elif isinstance(event, CallStart):
                blocks.to(
                    "tool_use",
                    {"type": "tool_use", "id": _tool_use_id(), "name": event.name, "input": {}},
                )
            elif isinstance(event, CallArgs):
                blocks.delta("input_json_delta", partial_json=event.text)
        for out in blocks.take():
            yield out
    if reader.finish == Finish.ERROR:
        raise InternalError(f"the engine failed this request: {reader.error}")
    blocks.close()
    for out in blocks.take():
        yield out
    reason, sequence = _stop_reason(reader.finish, reader.stop_reason, reader.num_calls > 0)
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": _usage(run, reader.num_tokens),
    }
    yield {"type": "message_stop"}
