"""POST /v1/completions: prompt (text or token ids) in, text out, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from msgspec.structs import replace
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.api.common.call import (
    FINISH_REASONS,
    EngineCall,
    Generation,
    collect_all,
    predictions,
)
from frontend.api.common.choices import best, check_choices, merged, start_choices
from frontend.api.common.context import ServingContext, check_model, now_s
from frontend.api.common.protocol import (
    CompletionRequest,
    check_prompt_ids,
    resolve_max_tokens,
    to_engine_params,
)
from frontend.api.common.sse import sse_stream
from frontend.api.common.structured import checked_grammar
from frontend.api.common.usage import usage
from wire.records import Finish, TokenLogprob

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


class CompletionLogprobs:
    """Renders OpenAI completions logprobs; ``text_offset`` runs across stream chunks."""

    def __init__(self) -> None:
        self.offset = 0

    def render(self, lps: list[TokenLogprob]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for t in lps:
            out["tokens"].append(t.token)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({t.token: t.logprob, **dict(t.top)})
            out["text_offset"].append(self.offset)
            self.offset += len(t.token)
        return out


async def _prompt_ids(ctx: ServingContext, prompt: str | list[Any]) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one (larger batches were rejected)
    if isinstance(prompt, str):
        if not prompt:
            check_prompt_ids([], ctx.settings.vocab_size, "prompt")
        return await ctx.encode(prompt, add_special_tokens=True)
    check_prompt_ids(prompt, ctx.settings.vocab_size, "prompt")
    return list(prompt)


async def create_completion(
    ctx: ServingContext, request: Request, body: CompletionRequest, arrival: float
) -> Response:
    body.reject_unsupported()
    lora = check_model(ctx, body.model)
    n, runs = check_choices(body.n, body.best_of, body.stream)
    prompt_ids = await _prompt_ids(ctx, body.prompt)
    requested = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), ctx.settings.max_model_len)
    s = ctx.settings
    grammar = await checked_grammar(ctx.grammars, body, s)
    # best_of ranks the choices by cumulative logprob: the engine must report them.
    logprobs = 0 if body.logprobs is None and runs > n else body.logprobs
    sampling, detok = to_engine_params(
        body, max_tokens, logprobs, s.vocab_size, s.max_logprobs, grammar
    )
    sampling = replace(sampling, lora=lora)
    calls = await start_choices(ctx, request, prompt_ids, sampling, detok, runs, arrival)
    head = {"id": f"cmpl-{calls[0].req.rid:x}", "created": now_s(), "model": s.model_name}
    echo = _echo_text(ctx, body, prompt_ids)
    if body.stream:
        chunks = _stream_chunks(calls, body, head, echo)
        return StreamingResponse(
            sse_stream(chunks, calls[0].req.rid), media_type="text/event-stream"
        )
    gens = await collect_all(calls, request)
    choices = [_choice(i, gen, body, prompt_ids, echo) for i, gen in enumerate(best(gens, n))]
    return JSONResponse(
        {
            **head,
            "object": "text_completion",
            "choices": choices,
            "usage": usage(
                len(prompt_ids),
                sum(len(g.token_ids) for g in gens),
                calls[0].cached_tokens,
                predictions=predictions(calls),
            ),
        }
    )


def _echo_text(ctx: ServingContext, body: CompletionRequest, prompt_ids: list[int]) -> str:
    """The prompt as ``echo`` returns it: the text given, or the ids decoded."""
    if not body.echo:
        return ""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    return str(ctx.tokenizer.decode(prompt_ids, skip_special_tokens=False))


def _choice(
    index: int, gen: Generation, body: CompletionRequest, prompt_ids: list[int], echo: str
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": echo + gen.text,
        "logprobs": CompletionLogprobs().render(gen.logprobs)
        if body.logprobs is not None
        else None,
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_reason,
    }
    if body.return_token_ids:
        choice.update(prompt_token_ids=prompt_ids, token_ids=gen.token_ids)
    if gen.finish == Finish.ERROR:
        choice["error"] = gen.error
    return choice


async def _stream_chunks(
    calls: list[EngineCall], body: CompletionRequest, head: dict[str, Any], echo: str
) -> AsyncIterator[dict[str, Any]]:
    logprobs = [CompletionLogprobs() if body.logprobs is not None else None for _ in calls]
    first = [True] * len(calls)
    num_tokens = 0
    async for i, d in merged(calls):
        num_tokens += len(d.token_ids)
        lp = logprobs[i]
        choice: dict[str, Any] = {
            "index": i,
            "text": echo + d.text if first[i] else d.text,
            "logprobs": lp.render(d.logprobs or []) if lp is not None else None,
            "finish_reason": FINISH_REASONS.get(Finish(d.finish)),
            "stop_reason": d.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
            if first[i]:
                choice["prompt_token_ids"] = calls[i].req.prompt_ids
        if d.error:
            choice["error"] = d.error
        first[i] = False
        yield {**head, "object": "text_completion", "choices": [choice], "usage": None}
    if body.include_usage:
        final = usage(
            len(calls[0].req.prompt_ids),
            num_tokens,
            calls[0].cached_tokens,
            predictions=predictions(calls),
        )
        yield {**head, "object": "text_completion", "choices": [], "usage": final}
