"""POST /generate: the native API (SGLang-like), text or token ids in, text + ids out.

Streaming sends one SSE event per engine delta: ``{"text": <new text>, "output_ids": <new
ids>, "finish_reason": null | "stop" | ...}``; the last event carries ``usage``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.api.common.call import FINISH_REASONS, EngineCall, predictions
from frontend.api.common.context import ServingContext
from frontend.api.common.protocol import (
    NativeGenerateRequest,
    check_prompt_ids,
    resolve_max_tokens,
    to_engine_params,
)
from frontend.api.common.sse import sse_stream
from frontend.api.common.usage import usage
from frontend.engine_link.engine_client import EngineRequest
from frontend.errors import InvalidRequest
from wire.records import Finish

DEFAULT_MAX_NEW_TOKENS = 128


async def generate(
    ctx: ServingContext, request: Request, body: NativeGenerateRequest, arrival: float
) -> Response:
    body.reject_unsupported()
    s, sp = ctx.settings, body.sampling_params
    if body.input_ids is not None:
        check_prompt_ids(body.input_ids, s.vocab_size, "input_ids")
        prompt_ids = list(body.input_ids)
    else:
        assert body.text is not None
        prompt_ids = await ctx.encode(body.text, add_special_tokens=True)
        check_prompt_ids(prompt_ids, s.vocab_size, "text")
    if sp.max_new_tokens is not None and sp.max_tokens is not None:
        raise InvalidRequest("give max_new_tokens or max_tokens, not both", param="max_tokens")
    requested = next(
        (v for v in (sp.max_new_tokens, sp.max_tokens) if v is not None), DEFAULT_MAX_NEW_TOKENS
    )
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), s.max_model_len)
    sampling, detok = to_engine_params(sp, max_tokens, sp.logprobs, s.vocab_size, s.max_logprobs)
    req = EngineRequest(rid=ctx.next_rid(), prompt_ids=prompt_ids, sampling=sampling, detok=detok)
    call = EngineCall(ctx, req, arrival)
    await call.start(request)
    if body.stream:
        return StreamingResponse(
            sse_stream(_stream_chunks(call), req.rid), media_type="text/event-stream"
        )
    gen = await call.collect(request)
    out: dict[str, Any] = {
        "text": gen.text,
        "output_ids": gen.token_ids,
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_reason,
        "usage": usage(
            len(prompt_ids), len(gen.token_ids), call.cached_tokens, predictions=predictions([call])
        ),
    }
    if gen.finish == Finish.ERROR:
        out["error"] = gen.error
    return JSONResponse(out)


async def _stream_chunks(call: EngineCall) -> AsyncIterator[dict[str, Any]]:
    num_tokens = 0
    async for d in call.deltas():
        num_tokens += len(d.token_ids)
        chunk: dict[str, Any] = {
            "text": d.text,
            "output_ids": list(d.token_ids),
            "finish_reason": FINISH_REASONS.get(Finish(d.finish)),
        }
        if d.finish:
            chunk["stop_reason"] = d.stop_reason
            chunk["usage"] = usage(
                len(call.req.prompt_ids),
                num_tokens,
                call.cached_tokens,
                predictions=predictions([call]),
            )
        if d.error:
            chunk["error"] = d.error
        yield chunk
