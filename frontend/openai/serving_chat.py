"""POST /v1/chat/completions: messages through the chat template, text out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.errors import InvalidRequest
from frontend.openai.chat_prompt import encode_chat, encode_rendered
from frontend.openai.choices import check_choices, merged, start_choices
from frontend.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    check_prompt_ids,
    resolve_max_tokens,
    to_engine_params,
)
from frontend.openai.serving_common import (
    FINISH_REASONS,
    EngineCall,
    Generation,
    ServingContext,
    collect_all,
    now_s,
    sse_stream,
    usage,
)
from frontend.openai.serving_completions import check_model
from frontend.openai.structured import checked_grammar, compile_checked
from frontend.openai.tools import ToolCallDeltas, ToolPlan, parse_output, plan_tools
from wire.params import GrammarSpec
from wire.records import Finish, TokenLogprob


def render_chat_logprobs(lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    def entry(token: str, logprob: float, raw: bytes) -> dict[str, Any]:
        # Raw bytes when the engine sent them: a token holding part of a character has
        # U+FFFD in its text but its true bytes here, so clients can reassemble it.
        return {"token": token, "logprob": logprob, "bytes": list(raw or token.encode())}

    def top(t: TokenLogprob) -> list[dict[str, Any]]:
        raws = t.top_bytes or [b""] * len(t.top)
        return [entry(s, lp, raw) for (s, lp), raw in zip(t.top, raws, strict=True)]

    return [{**entry(t.token, t.logprob, t.token_bytes), "top_logprobs": top(t)} for t in lps]


def chat_prompt_ids(
    ctx: ServingContext, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The messages (and ``tools``) through the chat template, tokenized; content stays
    text unless the server allows special tokens in it (``frontend/openai/chat_prompt.py``)."""
    template = ctx.settings.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest(
            "this model has no chat template; use /v1/completions or start the server "
            "with --chat-template",
            param="messages",
        )
    conversation = [_template_message(i, m) for i, m in enumerate(body.messages)]
    encode = encode_rendered if ctx.settings.allow_special_tokens_in_content else encode_chat
    try:
        return encode(ctx.tokenizer, template, conversation, body.add_generation_prompt, tools)
    except Exception as e:  # jinja's raise_exception: e.g. roles must alternate
        raise InvalidRequest(
            f"the chat template rejected the messages: {e}", param="messages"
        ) from e


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """A history message as chat templates read it."""
    out: dict[str, Any] = {"role": m.role, "content": m.text(i)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        # Templates render arguments with ``tojson``: they want the object, not its text.
        out["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name,
                          "arguments": _arguments(c.function.arguments, i)}}
            for c in m.tool_calls
        ]  # fmt: skip
    return out


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequest("tool call arguments must be JSON text",
                             param=f"messages.{i}.tool_calls") from e  # fmt: skip


async def create_chat_completion(
    ctx: ServingContext, request: Request, body: ChatCompletionRequest, arrival: float
) -> Response:
    body.reject_unsupported()
    check_model(ctx, body.model)
    n, _ = check_choices(body.n, None, body.stream)
    plan = plan_tools(body, ctx.settings.tool_call_parser)
    # Jinja over a long conversation takes seconds: off the loop, or every stream stalls.
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, ctx, body, plan.template_tools)
    s = ctx.settings
    check_prompt_ids(prompt_ids, s.vocab_size, "messages")
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), s.max_model_len)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await _grammar(ctx, body, plan)
    sampling, detok = to_engine_params(
        body, max_tokens, num_logprobs, s.vocab_size, s.max_logprobs, grammar
    )
    calls = await start_choices(ctx, request, prompt_ids, sampling, detok, n, arrival)
    head = {"id": f"chatcmpl-{calls[0].req.rid:x}", "created": now_s(), "model": s.model_name}
    if body.stream:
        chunks = _stream_chunks(calls, body, head, plan)
        return StreamingResponse(sse_stream(chunks, calls[0].req.rid),
                                 media_type="text/event-stream")  # fmt: skip
    gens = await collect_all(calls, request)
    response: dict[str, Any] = {
        **head,
        "object": "chat.completion",
        "choices": [_choice(i, gen, body, plan) for i, gen in enumerate(gens)],
        "usage": usage(
            len(prompt_ids), sum(len(g.token_ids) for g in gens), calls[0].cached_tokens
        ),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return JSONResponse(response)


async def _grammar(
    ctx: ServingContext, body: ChatCompletionRequest, plan: ToolPlan
) -> GrammarSpec | None:
    """The output constraint: the request's own, or the one its tool_choice needs."""
    own = await checked_grammar(ctx.grammars, body)
    if plan.grammar is None:
        return own
    if own is not None:
        raise InvalidRequest("tool_choice 'required' or a named function cannot be combined "
                             "with another output constraint", param="tool_choice")  # fmt: skip
    await compile_checked(ctx.grammars, plan.grammar, "tools")
    return plan.grammar


def _choice(
    index: int, gen: Generation, body: ChatCompletionRequest, plan: ToolPlan
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": gen.text}
    finish = gen.finish_reason
    if plan.parser is not None and gen.finish != Finish.ERROR:
        parsed = parse_output(plan.parser(), gen.text)
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls" if finish == "stop" and not plan.named else finish
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": {"content": render_chat_logprobs(gen.logprobs)} if body.logprobs else None,
        "finish_reason": finish,
        "stop_reason": gen.stop_reason,
    }
    if body.return_token_ids:
        choice["token_ids"] = gen.token_ids
    if gen.finish == Finish.ERROR:
        choice["error"] = gen.error
    return choice


async def _stream_chunks(
    calls: list[EngineCall], body: ChatCompletionRequest, head: dict[str, Any], plan: ToolPlan
) -> AsyncIterator[dict[str, Any]]:
    def chunk(i: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
        return {**head, "object": "chat.completion.chunk", "choices": [choice], "usage": None}

    for i in range(len(calls)):
        first = chunk(i, {"role": "assistant", "content": ""})
        if body.return_token_ids:
            first["prompt_token_ids"] = calls[0].req.prompt_ids
        yield first
    parsers = [ToolCallDeltas(plan.parser()) if plan.parser else None for _ in calls]
    num_tokens = 0
    async for i, d in merged(calls):
        num_tokens += len(d.token_ids)
        finish = FINISH_REASONS.get(Finish(d.finish))
        tc = parsers[i]
        if tc is None:
            delta = {"content": d.text} if d.text else {}
        else:
            delta = tc.feed(d.text, final=bool(d.finish))
            if tc.num_calls and finish == "stop" and not plan.named:
                finish = "tool_calls"
        extra: dict[str, Any] = {"finish_reason": finish, "stop_reason": d.stop_reason}
        if body.logprobs:
            extra["logprobs"] = {"content": render_chat_logprobs(d.logprobs or [])}
        if body.return_token_ids:
            extra["token_ids"] = list(d.token_ids)
        if d.error:
            extra["error"] = d.error
        yield chunk(i, delta, **extra)
    if body.include_usage:
        final = usage(len(calls[0].req.prompt_ids), num_tokens, calls[0].cached_tokens)
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": final}
