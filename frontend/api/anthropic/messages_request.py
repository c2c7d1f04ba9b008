"""Anthropic's Messages API request, translated onto the internal chat request.

``MessagesRequest`` is the body of ``POST /v1/messages`` (``CountTokensRequest`` that of
``/v1/messages/count_tokens``), checked as strictly as the OpenAI bodies are. ``to_chat``
turns it into the ``ChatCompletionRequest`` every chat-shaped API runs through
(``frontend/api/chat/run.py``), so that tools, grammars, sampling and the request's
life in the engine are the chat path's own. What maps onto what:

    system (a string or text blocks)       a leading system message
    user text blocks                       a user message
    user tool_result blocks                a tool message each (tool_call_id = tool_use_id)
    assistant text / tool_use blocks       an assistant message: content / tool_calls
    assistant thinking blocks              dropped: chat templates do not replay reasoning
    a final assistant turn of text         continued by the reply (continue_final_message)
    tools[].input_schema                   tools[].function.parameters
    tool_choice auto / any / tool / none   auto / required / that function / none
    disable_parallel_tool_use              parallel_tool_calls: false
    stop_sequences, temperature, top_p, top_k, max_tokens: the same sampling fields
    output_config.format (json_schema)     response_format json_schema (structured output)

Refused with a 400 that names the block or field: content no model here can read (images,
documents), a block type nobody knows, a ``tool_result`` answering no earlier ``tool_use``,
a conversation that does not start with a user turn, and tools Anthropic runs on its own
servers (web search, code execution, ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from frontend.api.common.protocol import Body, ChatCompletionRequest, parse_body
from frontend.errors import InvalidRequest, NotImplementedField

# Block types of the API whose content no model served here can read.
_UNREADABLE = {
    "image": "images need a vision model, and none is served here",
    "document": "documents (PDF, text sources) are not read by this server",
    "search_result": "search results are not supported by this server",
    "container_upload": "file uploads are not supported by this server",
}


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class BlockParam(Body):
    """A content block as it arrives: its ``type`` checked, the rest checked by the
    block's own model once the type names it (``_blocks``)."""

    type: str = Field(examples=["text", "tool_use", "tool_result", "thinking", "image"])


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[BlockParam] | None = None
    is_error: bool = False


class ThinkingBlock(Body):
    type: Literal["thinking", "redacted_thinking"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
_BLOCKS: dict[str, type[Body]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: str | list[BlockParam]


class ToolParam(Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolEntry(Body):
    """A tool as it arrives: a client tool (no type, or ``custom``) or one of Anthropic's
    server tools (refused by ``_tool``)."""

    type: str | None = Field(None, examples=["custom", "web_search_20250305"])


class ToolChoiceParam(Body):
    type: str = Field(examples=["auto", "any", "tool", "none"])
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputConfig(Body):
    effort: str | None = None
    format: dict[str, Any] | None = None


class CountTokensRequest(Body):
    """``/v1/messages/count_tokens``: what makes the prompt, nothing about sampling."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolEntry] | None = None
    tool_choice: ToolChoiceParam | None = None
    # Accepted: whether a model reasons is its chat template's choice; with
    # --reasoning-parser its reasoning comes back as thinking blocks (docs/api.md).
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted: user_id feeds Anthropic's abuse checks
    service_tier: str | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None
    output_config: OutputConfig | None = None

    def reject_unsupported(self) -> None:
        config = self.output_config or OutputConfig()
        if config.effort is not None:
            raise NotImplementedField(
                "output_config.effort",
                "how long a model reasons is its own (and its chat template's) choice here",
            )
        if unknown := config.unknown_fields():
            raise NotImplementedField(f"output_config.{unknown[0]}", "only 'format' is served")
        if self.container is not None:
            raise NotImplementedField("container", "code-execution containers are not hosted here")
        if self.mcp_servers:
            raise NotImplementedField("mcp_servers", "this server does not call MCP servers")
        if self.service_tier not in (None, "auto", "standard_only"):
            raise NotImplementedField("service_tier", "there is one service tier")


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The internal chat request ``body`` means; a 400 naming the field if it means none."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        messages.append({"role": "system", "content": system})
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    if body.messages[0].role != "user":
        raise InvalidRequest(
            "messages[0]: the first message must have the 'user' role", param="messages[0].role"
        )
    tool_uses: set[str] = set()
    for i, m in enumerate(body.messages):
        blocks = _blocks(f"messages[{i}].content", m.content)
        if m.role == "user":
            messages += _user_turn(i, blocks, tool_uses)
        else:
            messages.append(_assistant_turn(i, blocks, tool_uses))
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    last = messages[-1]
    if last["role"] == "assistant":
        if last.get("tool_calls"):
            raise InvalidRequest(
                "the last message is an assistant turn with tool_use blocks; "
                "send their tool_result blocks in a user turn",
                param=f"messages[{len(body.messages) - 1}]",
            )
        if last["content"]:  # the reply continues this text (Anthropic's "prefill")
            fields.update(continue_final_message=True, add_generation_prompt=False)
        else:
            messages.pop()
    tools = [_tool(i, t) for i, t in enumerate(body.tools or [])]
    if tools:
        fields["tools"] = tools
    fields.update(_tool_choice(body.tool_choice, bool(tools)))
    if isinstance(body, MessagesRequest):
        fields.update(_sampling(body))
    chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, fields)
    return chat


def _sampling(body: MessagesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            out[name] = getattr(body, name)
    if body.stop_sequences:
        out["stop"] = body.stop_sequences
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        if fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise InvalidRequest(
                'output_config.format must be {"type": "json_schema", "schema": {...}}',
                param="output_config.format",
            )
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"]},
        }
    return out


def _blocks(
    where: str, content: str | list[BlockParam], allowed: tuple[str, ...] = ()
) -> list[Block]:
    """``content`` (at path ``where``) as typed blocks; ``allowed``: the only types it may
    hold (else any)."""
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    out: list[Block] = []
    for j, raw in enumerate(content):
        param = f"{where}[{j}]"
        kind = raw.type
        if kind in _UNREADABLE:
            raise InvalidRequest(
                f"{param}: content blocks of type '{kind}' are not supported: {_UNREADABLE[kind]}",
                param=f"{param}.type",
            )
        known = allowed or tuple(_BLOCKS)
        if kind not in known:
            raise InvalidRequest(
                f"{param}: unknown content block type {kind!r}; expected one of {', '.join(known)}",
                param=f"{param}.type",
            )
        out.append(parse_body(_BLOCKS[kind], raw.model_dump(), prefix=param))
    return out


def _user_turn(i: int, blocks: list[Block], tool_uses: set[str]) -> list[dict[str, Any]]:
    """Tool results first (a tool message each, as chat templates want them), then the
    user's text."""
    out: list[dict[str, Any]] = []
    text = ""
    for j, b in enumerate(blocks):
        param = f"messages[{i}].content[{j}]"
        if isinstance(b, ToolResultBlock):
            if b.tool_use_id not in tool_uses:
                raise InvalidRequest(
                    f"{param}: the tool_result's tool_use_id "
                    f"{b.tool_use_id!r} matches no earlier tool_use block",
                    param=f"{param}.tool_use_id",
                )
            result = b.content if b.content is not None else ""
            if not isinstance(result, str):
                parts = _blocks(f"{param}.content", result, ("text",))
                result = "".join(t.text for t in parts if isinstance(t, TextBlock))
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": f"Error: {result}" if b.is_error else result,
                }
            )
        elif isinstance(b, TextBlock):
            text += b.text
        else:
            raise InvalidRequest(
                f"{param}: a user turn cannot hold a '{b.type}' block", param=f"{param}.type"
            )
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant_turn(i: int, blocks: list[Block], tool_uses: set[str]) -> dict[str, Any]:
    text, calls = "", []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text += b.text
        elif isinstance(b, ToolUseBlock):
            tool_uses.add(b.id)
            calls.append(
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
            )
        elif isinstance(b, ToolResultBlock):
            raise InvalidRequest(
                f"messages[{i}].content[{j}]: tool_result blocks belong in a user turn",
                param=f"messages[{i}].content[{j}].type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(i: int, entry: ToolEntry) -> dict[str, Any]:
    kind = entry.type
    if kind not in (None, "custom"):
        raise NotImplementedField(
            f"tools[{i}].type",
            f"tool type {kind!r}: Anthropic's own "
            "tools run on its servers; only client tools (name, "
            "description, input_schema) are served here",
        )
    raw = entry.model_dump(exclude={"type"})
    tool = parse_body(ToolParam, raw, f"tools[{i}]")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema  # after the description, as OpenAI's tools have it
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoiceParam | None, have_tools: bool) -> dict[str, Any]:
    if choice is None:
        return {}
    out: dict[str, Any] = {}
    if choice.disable_parallel_tool_use is True:
        out["parallel_tool_calls"] = False
    kind = choice.type
    if kind == "auto":
        out["tool_choice"] = "auto" if have_tools else "none"
    elif kind in ("any", "none"):
        out["tool_choice"] = "required" if kind == "any" else "none"
    elif kind == "tool" and choice.name is not None:
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        raise InvalidRequest(
            'tool_choice must be {"type": "auto" | "any" | "none"} or '
            '{"type": "tool", "name": ...}',
            param="tool_choice",
        )
    return out
