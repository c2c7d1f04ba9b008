"""POST /v1/responses: OpenAI's Responses API, stateless.

The body becomes the internal chat request (``responses_request.to_chat``) and runs as a
chat completion does (``chat_run.start_chat``); the output, read by ``answer.py``, is
written as the response's ``output`` items: ``reasoning`` (with ``--reasoning-parser``),
``message`` (its ``output_text``) and ``function_call``. Streamed, as the API's events,
each with its ``sequence_number``:

    response.created, response.in_progress          the response, empty
    response.output_item.added                       an item opens (output_index 0, 1, ...)
      response.content_part.added                    its part (reasoning_text, output_text)
      response.reasoning_text.delta / .done          reasoning
      response.output_text.delta / .done             the answer
      response.function_call_arguments.delta / .done a call's arguments
      response.content_part.done
    response.output_item.done                        it closes (before the next one opens)
    response.completed | response.incomplete         the whole response (cut by
                                                     max_output_tokens: incomplete)
    response.failed                                  the engine failed the request
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.api.chat.answer import (
    AnswerEvents,
    CallArgs,
    CallStart,
    Content,
    Reasoning,
    read_answer,
)
from frontend.api.chat.run import ChatRun, start_translated
from frontend.api.chat.tools import new_call_id
from frontend.api.common.call import collect_all
from frontend.api.common.context import ServingContext
from frontend.api.common.sse import typed_sse_stream
from frontend.api.openai.responses_request import ResponsesRequest, to_chat
from frontend.errors import APIError, EngineFailed
from wire.records import Finish


async def create_response(
    ctx: ServingContext, request: Request, body: ResponsesRequest, arrival: float
) -> Response:
    translate = partial(to_chat, max_depth=ctx.settings.max_json_depth)
    run = await start_translated(ctx, request, body, translate, arrival)
    shell = _shell(ctx, body, run)
    if body.stream:
        return StreamingResponse(
            typed_sse_stream(_stream(run, shell), run.rid, _error_event),
            media_type="text/event-stream",
        )
    (gen,) = await collect_all(run.calls, request)
    answer = read_answer(gen, run.plan)
    if answer.finish == Finish.ERROR:
        raise EngineFailed(answer.error)
    items = _Items()
    if answer.reasoning:
        items.open("reasoning").text = answer.reasoning
    if answer.content:
        items.open("message").text = answer.content
    for call in answer.tool_calls:
        items.open("function_call", call["function"]["name"]).text = call["function"]["arguments"]
    items.close(answer.finish)
    return JSONResponse(
        _final(shell, items, answer.finish, run, answer.num_tokens, answer.reasoning_tokens)
    )


def _shell(ctx: ServingContext, body: ResponsesRequest, run: ChatRun) -> dict[str, Any]:
    """The response object as it stands before any output: what the request set."""
    tools = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "description": t["function"].get("description"),
            "parameters": t["function"]["parameters"],
            "strict": None,
        }
        for t in run.plan.template_tools or []
    ]
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {
        "id": f"resp_{run.rid:x}{secrets.token_hex(4)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": ctx.settings.model_name,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "metadata": body.metadata or {},
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools,
        "tool_choice": _choice(body),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": fmt},
        "store": False,
        "previous_response_id": None,
        "reasoning": None,
        "truncation": "disabled",
        "user": body.user,
        "usage": None,
    }


def _choice(body: ResponsesRequest) -> str | dict[str, Any]:
    """The request's ``tool_choice``, echoed as it came."""
    choice = body.tool_choice or "auto"
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)


def _final(
    shell: dict[str, Any],
    items: _Items,
    finish: Finish,
    run: ChatRun,
    num_tokens: int,
    reasoning_tokens: int,
) -> dict[str, Any]:
    cached, prompt = run.cached_tokens or 0, len(run.prompt_ids)
    cut = finish == Finish.LENGTH
    return {
        **shell,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [item.render() for item in items.done],
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": num_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + num_tokens,
        },
    }


def _error_event(err: APIError) -> dict[str, Any]:
    return {"type": "error", "code": err.code, "message": err.message, "param": err.param}


@dataclass
class _Item:
    kind: str  # reasoning | message | function_call
    id: str
    name: str = ""  # a function call's
    call_id: str = ""
    text: str = ""  # reasoning, output text, or a call's arguments
    status: str = "in_progress"

    def render(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {
                "type": "reasoning",
                "id": self.id,
                "summary": [],
                "status": self.status,
                "content": [{"type": "reasoning_text", "text": self.text}],
            }
        if self.kind == "message":
            return {
                "type": "message",
                "id": self.id,
                "role": "assistant",
                "status": self.status,
                "content": [_text_part(self.text)],
            }
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text,
            "status": self.status,
        }

    def shell(self) -> dict[str, Any]:
        """As ``output_item.added`` announces it: nothing written yet."""
        item = self.render()
        if self.kind != "function_call":
            item["content"] = []
        return item


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _Items:
    """The output items: the closed ones, and the one being written."""

    done: list[_Item] = field(default_factory=list)
    current: _Item | None = None

    def open(self, kind: str, name: str = "") -> _Item:
        self.close(None)
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.current = _Item(
            kind,
            f"{prefix}_{secrets.token_hex(12)}",
            name,
            new_call_id() if kind == "function_call" else "",
        )
        return self.current

    def close(self, finish: Finish | None) -> None:
        """Close the open item (``finish``: the output ended; LENGTH leaves it incomplete)."""
        if self.current is not None:
            self.current.status = "incomplete" if finish == Finish.LENGTH else "completed"
            self.done.append(self.current)
            self.current = None


@dataclass
class _Events:
    """Response events, numbered in order."""

    seq: int = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event


async def _stream(run: ChatRun, shell: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    ev, items, reader = _Events(), _Items(), AnswerEvents(run.plan)
    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    async for d in run.calls[0].deltas():
        for event in reader.feed(d):
            kind = {
                Reasoning: "reasoning",
                Content: "message",
                CallStart: "function_call",
                CallArgs: "function_call",
            }[type(event)]
            item = items.current
            if item is None or item.kind != kind or isinstance(event, CallStart):
                for out in _close(ev, items, None):
                    yield out
                item = items.open(kind, event.name if isinstance(event, CallStart) else "")
                for out in _opened(ev, items):
                    yield out
            if isinstance(event, CallStart):
                continue
            item.text += event.text
            yield _delta(ev, items, event.text)
    if reader.finish == Finish.ERROR:
        failed = {
            **shell,
            "status": "failed",
            "error": {
                "code": "server_error",
                "message": f"the engine failed this request: {reader.error}",
            },
        }
        yield ev("response.failed", response=failed)
        return
    for out in _close(ev, items, reader.finish):
        yield out
    final = _final(shell, items, reader.finish, run, reader.num_tokens, reader.reasoning_tokens)
    done = "response.incomplete" if reader.finish == Finish.LENGTH else "response.completed"
    yield ev(done, response=final)


def _where(items: _Items) -> dict[str, Any]:
    assert items.current is not None
    return {"item_id": items.current.id, "output_index": len(items.done)}


def _part(item: _Item) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "reasoning_text", "text": item.text}
    return _text_part(item.text)


def _opened(ev: _Events, items: _Items) -> list[dict[str, Any]]:
    item = items.current
    assert item is not None
    out = [ev("response.output_item.added", output_index=len(items.done), item=item.shell())]
    if item.kind != "function_call":
        out.append(
            ev("response.content_part.added", **_where(items), content_index=0, part=_part(item))
        )
    return out


def _delta(ev: _Events, items: _Items, text: str) -> dict[str, Any]:
    item = items.current
    assert item is not None
    if item.kind == "function_call":
        return ev("response.function_call_arguments.delta", **_where(items), delta=text)
    kind = "reasoning_text" if item.kind == "reasoning" else "output_text"
    extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
    return ev(f"response.{kind}.delta", **_where(items), content_index=0, delta=text, **extra)


def _close(ev: _Events, items: _Items, finish: Finish | None) -> list[dict[str, Any]]:
    item = items.current
    if item is None:
        return []
    where, out = _where(items), []
    if item.kind == "function_call":
        out.append(
            ev(
                "response.function_call_arguments.done",
                **where,
                name=item.name,
                arguments=item.text,
            )
        )
    else:
        kind = "reasoning_text" if item.kind == "reasoning" else "output_text"
        extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
        out.append(ev(f"response.{kind}.done", **where, content_index=0, text=item.text, **extra))
        out.append(ev("response.content_part.done", **where, content_index=0, part=_part(item)))
    items.close(finish)
    out.append(
        ev("response.output_item.done", output_index=where["output_index"], item=item.render())
    )
    return out
