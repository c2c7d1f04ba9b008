"""POST /tokenize and /detokenize, GET /version: the model's tokenizer over HTTP, as vLLM
shapes them, so tools written for vLLM count tokens the same way here."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.api.chat.run import chat_prompt_ids
from frontend.api.common.context import ServingContext, check_model
from frontend.api.common.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_prompt_ids,
)


async def tokenize(
    ctx: ServingContext, request: Request, body: TokenizeRequest, arrival: float
) -> Response:
    body.reject_unsupported()
    check_model(ctx, body.model)
    if body.messages is not None:
        chat = ChatCompletionRequest.model_construct(
            messages=body.messages, add_generation_prompt=body.add_generation_prompt
        )
        # As a chat completion would tokenize it (content special tokens stay text).
        ids = await asyncio.to_thread(chat_prompt_ids, ctx, chat)
    else:
        assert body.prompt is not None
        ids = await ctx.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out: dict[str, object] = {
        "count": len(ids),
        "max_model_len": ctx.settings.max_model_len,
        "tokens": ids,
        "token_strs": ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }
    return JSONResponse(out)


async def detokenize(
    ctx: ServingContext, request: Request, body: DetokenizeRequest, arrival: float
) -> Response:
    check_model(ctx, body.model)
    check_prompt_ids(body.tokens, ctx.settings.vocab_size, "tokens")
    text = await asyncio.to_thread(ctx.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


def server_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


def version_response() -> Response:
    return JSONResponse({"version": server_version()})
