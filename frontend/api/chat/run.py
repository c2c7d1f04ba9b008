"""The one internal request behind every chat-shaped API: prompt, constraints, admission.

Chat completions, Anthropic's Messages and OpenAI's Responses differ only in their
shapes. Each handler translates its body into a ``ChatCompletionRequest`` and calls
``start_chat``, which does everything once: the chat template, tools and their grammar,
structured output, sampling and detokenizer parameters (the reasoning split included),
and admission into the engine (``EngineCall``: abort on client disconnect, metrics;
recovery lives below, in the engine client). The output comes back through
``frontend/api/chat/answer.py``; each API writes it in its own format.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace
from starlette.requests import Request

from detokenizer.reasoning import CLOSE, OPEN
from frontend.api.chat.prompt import ChatPrompt, encode_chat, encode_rendered
from frontend.api.chat.tools import ToolPlan, plan_tools
from frontend.api.common.call import EngineCall
from frontend.api.common.choices import start_choices
from frontend.api.common.context import ServingContext, check_model
from frontend.api.common.limits import check_size, decode_json_text
from frontend.api.common.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    check_prompt_ids,
    resolve_max_tokens,
    to_engine_params,
)
from frontend.api.common.structured import checked_grammar, compile_checked
from frontend.errors import InvalidRequest
from wire.params import GrammarSpec, LoraRef, ReasoningMode

# Prompt tokens decoded to see whether the template left a <think> block open.
_TAIL_TOKENS = 8


@dataclass
class ChatRun:
    """A started chat request: its engine calls (one per choice), tools and prompt."""

    calls: list[EngineCall]
    plan: ToolPlan
    prompt_ids: list[int]

    @property
    def rid(self) -> int:
        return self.calls[0].req.rid

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the prefix cache supplied (None until the engine said)."""
        return self.calls[0].cached_tokens


def chat_prompt_ids(
    ctx: ServingContext, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The messages (and ``tools``) through the chat template, tokenized; content stays
    text unless the server allows special tokens in it (``frontend/api/chat/prompt.py``)."""
    template = ctx.settings.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest(
            "this model has no chat template; use /v1/completions or start the server "
            "with --chat-template",
            param="messages",
        )
    depth = ctx.settings.max_json_depth
    conversation = [_template_message(i, m, depth) for i, m in enumerate(body.messages)]
    encode = encode_rendered if ctx.settings.allow_special_tokens_in_content else encode_chat
    try:
        return encode(
            ctx.tokenizer,
            ChatPrompt(
                template,
                conversation,
                body.add_generation_prompt,
                tools,
                continue_final_message=body.continue_final_message,
            ),
        )
    except Exception as e:  # jinja's raise_exception: e.g. roles must alternate
        raise InvalidRequest(
            f"the chat template rejected the messages: {e}", param="messages"
        ) from e


def _template_message(i: int, m: ChatMessage, max_depth: int) -> dict[str, Any]:
    """A history message as chat templates read it."""
    out: dict[str, Any] = {"role": m.role, "content": m.text(i)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        # Templates render arguments with ``tojson``: they want the object, not its text.
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(
                        c.function.arguments,
                        f"messages[{i}].tool_calls[{k}].function.arguments",
                        max_depth,
                    ),
                },
            }
            for k, c in enumerate(m.tool_calls)
        ]
    return out


def _arguments(text: str, param: str, max_depth: int) -> Any:
    try:
        return decode_json_text(text, max_depth, param)
    except ValueError as e:
        raise InvalidRequest(f"{param}: tool call arguments must be JSON text", param=param) from e


async def start_translated(
    ctx: ServingContext,
    request: Request,
    body: Any,
    to_chat: Callable[[Any], ChatCompletionRequest],
    arrival: float,
) -> ChatRun:
    """Run another API's request as the chat request ``to_chat`` makes of it: what either
    side cannot serve is refused first (``reject_unsupported``), and the model checked."""
    body.reject_unsupported()
    lora = check_model(ctx, body.model)
    chat = to_chat(body)
    chat.reject_unsupported()
    return await start_chat(ctx, request, chat, arrival, lora)


async def start_chat(
    ctx: ServingContext,
    request: Request,
    body: ChatCompletionRequest,
    arrival: float,
    lora: LoraRef | None,
    n: int = 1,
) -> ChatRun:
    """Plan, tokenize, constrain and admit ``body`` (``n`` choices) on ``lora``, which the
    caller's ``check_model`` of the request's model gave; returns once each choice's first
    delta is in, so admission errors are raised before any byte is sent."""
    if body.tools:  # before any work is spent on them (frontend/api/common/limits.py)
        check_size(
            [t.model_dump(exclude_none=True) for t in body.tools],
            ctx.settings.max_tools_bytes,
            "max_tools_bytes",
            "tools",
        )
    plan = plan_tools(body, ctx.settings.tool_call_parser)
    # Jinja over a long conversation takes seconds: off the loop, or every stream stalls.
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, ctx, body, plan.template_tools)
    s = ctx.settings
    check_prompt_ids(prompt_ids, s.vocab_size, "messages")
    grammar = await _grammar(ctx, body, plan)
    mode = ReasoningMode.OFF
    if s.reasoning_parser is not None:
        opened = _leaves_block_open(ctx, body, prompt_ids)
        if grammar is not None and opened:
            # A grammar shapes the whole output, so the model cannot reason first: close the
            # block the template opened, as templates do when thinking is turned off.
            prompt_ids += ctx.tokenizer.encode(CLOSE + "\n\n", add_special_tokens=False)
        elif grammar is None:
            mode = ReasoningMode.OPEN if opened else ReasoningMode.AT_START
    max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), s.max_model_len)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling, detok = to_engine_params(
        body, max_tokens, num_logprobs, s.vocab_size, s.max_logprobs, grammar, mode
    )
    sampling = replace(sampling, lora=lora)
    calls = await start_choices(ctx, request, prompt_ids, sampling, detok, n, arrival)
    return ChatRun(calls, plan, prompt_ids)


def _leaves_block_open(
    ctx: ServingContext, body: ChatCompletionRequest, prompt_ids: list[int]
) -> bool:
    """Whether the prompt ends inside a ``<think>`` block: the generation prompt of a
    template that always reasons, or a reply being continued inside its reasoning."""
    if body.continue_final_message:
        last = body.messages[-1].text(len(body.messages) - 1)
        return last.lstrip().startswith(OPEN) and CLOSE not in last
    tail: str = ctx.tokenizer.decode(prompt_ids[-_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


async def _grammar(
    ctx: ServingContext, body: ChatCompletionRequest, plan: ToolPlan
) -> GrammarSpec | None:
    """The output constraint: the request's own, or the one its tool_choice needs."""
    own = await checked_grammar(ctx.grammars, body, ctx.settings)
    if plan.grammar is None:
        return own
    if own is not None:
        raise InvalidRequest(
            "tool_choice 'required' or a named function cannot be combined "
            "with another output constraint",
            param="tool_choice",
        )
    await compile_checked(ctx.grammars, plan.grammar, "tool_choice", ctx.settings)
    return plan.grammar
