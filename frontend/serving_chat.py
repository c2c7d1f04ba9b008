"""POST /v1/chat/completions: messages through the chat template, text out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.engine_client import EngineRequest
from frontend.errors import InvalidRequest
from frontend.protocol import (
    ChatCompletionRequest,
    check_prompt_ids,
    resolve_max_tokens,
    to_engine_params,
)
from frontend.serving_common import (
    FINISH_REASONS,
    EngineCall,
    ServingContext,
    now_s,
    sse_stream,
    usage,
)
from frontend.serving_completions import check_model
from frontend.structured import checked_grammar
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


def apply_chat_template(ctx: ServingContext, body: ChatCompletionRequest) -> str:
    template = ctx.settings.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest(
            "this model has no chat template; use /v1/completions or start the server "
            "with --chat-template",
            param="messages",
        )
    conversation = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
    try:
        text = ctx.tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
        )
    except Exception as e:  # jinja's raise_exception: e.g. roles must alternate
        raise InvalidRequest(
            f"the chat template rejected the messages: {e}", param="messages"
        ) from e
    assert isinstance(text, str)
    return text


async def create_chat_completion(
    ctx: ServingContext, request: Request, body: ChatCompletionRequest, arrival: float
) -> Response:
    body.reject_unsupported()
    check_model(ctx, body.model)
    # Jinja over a long conversation takes seconds: off the loop, or every stream stalls.
    text = await asyncio.to_thread(apply_chat_template, ctx, body)
    # The template writes BOS and role markers itself: no special tokens added again.
    prompt_ids = await ctx.encode(text, add_special_tokens=False)
    s = ctx.settings
    check_prompt_ids(prompt_ids, s.vocab_size, "messages")
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), s.max_model_len)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await checked_grammar(ctx.grammars, body)
    sampling, detok = to_engine_params(
        body, max_tokens, num_logprobs, s.vocab_size, s.max_logprobs, grammar
    )
    req = EngineRequest(rid=ctx.next_rid(), prompt_ids=prompt_ids, sampling=sampling, detok=detok)
    call = EngineCall(ctx, req, arrival)
    await call.start(request)
    head = {"id": f"chatcmpl-{req.rid:x}", "created": now_s(), "model": s.model_name}
    if body.stream:
        chunks = _stream_chunks(call, body, head)
        return StreamingResponse(sse_stream(chunks, req.rid), media_type="text/event-stream")
    gen = await call.collect(request)
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": gen.text},
        "logprobs": {"content": render_chat_logprobs(gen.logprobs)} if body.logprobs else None,
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_reason,
    }
    if body.return_token_ids:
        choice["token_ids"] = gen.token_ids
    if gen.finish == Finish.ERROR:
        choice["error"] = gen.error
    response: dict[str, Any] = {
        **head,
        "object": "chat.completion",
        "choices": [choice],
        "usage": usage(len(prompt_ids), len(gen.token_ids)),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return JSONResponse(response)


async def _stream_chunks(
    call: EngineCall, body: ChatCompletionRequest, head: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
        return {**head, "object": "chat.completion.chunk", "choices": [choice], "usage": None}

    first = chunk({"role": "assistant", "content": ""})
    if body.return_token_ids:
        first["prompt_token_ids"] = call.req.prompt_ids
    yield first
    num_tokens = 0
    async for d in call.deltas():
        num_tokens += len(d.token_ids)
        extra: dict[str, Any] = {
            "finish_reason": FINISH_REASONS.get(Finish(d.finish)),
            "stop_reason": d.stop_reason,
        }
        if body.logprobs:
            extra["logprobs"] = {"content": render_chat_logprobs(d.logprobs or [])}
        if body.return_token_ids:
            extra["token_ids"] = list(d.token_ids)
        if d.error:
            extra["error"] = d.error
        yield chunk({"content": d.text} if d.text else {}, **extra)
    if body.include_usage:
        final = usage(len(call.req.prompt_ids), num_tokens)
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": final}
