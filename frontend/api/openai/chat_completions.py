"""POST /v1/chat/completions: messages through the chat template, text out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.api.chat.answer import Answer, finish_reason, read_answer
from frontend.api.chat.run import start_chat
from frontend.api.chat.tools import ToolCallDeltas, ToolPlan
from frontend.api.common.call import EngineCall, Generation, collect_all, predictions
from frontend.api.common.choices import check_choices, merged
from frontend.api.common.context import ServingContext, check_model, now_s
from frontend.api.common.protocol import ChatCompletionRequest
from frontend.api.common.sse import sse_stream
from frontend.api.common.usage import usage
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


async def create_chat_completion(
    ctx: ServingContext, request: Request, body: ChatCompletionRequest, arrival: float
) -> Response:
    body.reject_unsupported()
    lora = check_model(ctx, body.model)
    n, _ = check_choices(body.n, None, body.stream)
    run = await start_chat(ctx, request, body, arrival, lora, n)
    calls, prompt_ids = run.calls, run.prompt_ids
    head = {"id": f"chatcmpl-{run.rid:x}", "created": now_s(), "model": ctx.settings.model_name}
    reasoning = ctx.settings.reasoning_parser is not None
    if body.stream:
        chunks = _stream_chunks(calls, body, head, run.plan, reasoning)
        return StreamingResponse(sse_stream(chunks, run.rid), media_type="text/event-stream")
    gens = await collect_all(calls, request)
    answers = [read_answer(gen, run.plan) for gen in gens]
    response: dict[str, Any] = {
        **head,
        "object": "chat.completion",
        "choices": [
            _choice(i, gen, a, body, reasoning)
            for i, (gen, a) in enumerate(zip(gens, answers, strict=True))
        ],
        "usage": usage(
            len(prompt_ids),
            sum(a.num_tokens for a in answers),
            run.cached_tokens,
            sum(a.reasoning_tokens for a in answers) if reasoning else None,
            predictions(calls),
        ),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return JSONResponse(response)


def _choice(
    index: int, gen: Generation, answer: Answer, body: ChatCompletionRequest, reasoning: bool
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if reasoning:  # vLLM's field name; null when the model did not reason
        message["reasoning_content"] = answer.reasoning or None
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": {"content": render_chat_logprobs(gen.logprobs)} if body.logprobs else None,
        "finish_reason": answer.finish_reason,
        "stop_reason": gen.stop_reason,
    }
    if body.return_token_ids:
        choice["token_ids"] = gen.token_ids
    if gen.finish == Finish.ERROR:
        choice["error"] = gen.error
    return choice


async def _stream_chunks(
    calls: list[EngineCall],
    body: ChatCompletionRequest,
    head: dict[str, Any],
    plan: ToolPlan,
    reasoning: bool,
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
    num_tokens, reasoning_tokens = 0, [0] * len(calls)
    async for i, d in merged(calls):
        num_tokens += len(d.token_ids)
        reasoning_tokens[i] = d.reasoning_tokens or reasoning_tokens[i]
        tc = parsers[i]
        if tc is None:
            delta = {"content": d.text} if d.text else {}
        else:  # the parser reads only the answer: reasoning never holds a call
            delta = tc.feed(d.text, final=bool(d.finish))
        if d.reasoning:
            delta = {"reasoning_content": d.reasoning, **delta}
        finish = finish_reason(Finish(d.finish), tc.num_calls if tc else 0, plan)
        extra: dict[str, Any] = {"finish_reason": finish, "stop_reason": d.stop_reason}
        if body.logprobs:
            extra["logprobs"] = {"content": render_chat_logprobs(d.logprobs or [])}
        if body.return_token_ids:
            extra["token_ids"] = list(d.token_ids)
        if d.error:
            extra["error"] = d.error
        yield chunk(i, delta, **extra)
    if body.include_usage:
        final = usage(
            len(calls[0].req.prompt_ids),
            num_tokens,
            calls[0].cached_tokens,
            sum(reasoning_tokens) if reasoning else None,
            predictions(calls),
        )
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": final}
