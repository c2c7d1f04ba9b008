"""OpenAI's Responses API request, translated onto the internal chat request.

``ResponsesRequest`` is the body of ``POST /v1/responses``; ``to_chat`` turns it into the
``ChatCompletionRequest`` every chat-shaped API runs through (``chat_run.py``):

    instructions                           a leading system message
    input (a string)                       one user message
    input items: message (system, developer, user, assistant; input_text / output_text parts)
                                           a message of that role
                 function_call             a call of the assistant turn it follows
                 function_call_output      a tool message (tool_call_id = call_id)
                 reasoning                 dropped: chat templates do not replay reasoning
    tools (type function)                  tools
    tool_choice none / auto / required / {"type": "function", "name"}   the same
    text.format text / json_object / json_schema                         response_format
    max_output_tokens, temperature, top_p  max_tokens, temperature, top_p

No state is kept: ``previous_response_id``, ``store: true``, ``conversation`` and
``background`` are refused with a 400 that says to send the whole conversation in
``input``. Images, files and audio, built-in tools (web search, file search, ...) and the
items they make are refused naming their type; so is a ``function_call_output`` that
answers no earlier ``function_call``, and an input whose first turn is the assistant's.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from frontend.api.common.limits import decode_json_text
from frontend.api.common.protocol import Body, ChatCompletionRequest, parse_body
from frontend.errors import InvalidRequest, NotImplementedField

_NO_STATE = (
    "this server keeps no responses: send the whole conversation in 'input' "
    "(and leave 'store' unset or false)"
)
_UNREADABLE_PARTS = {
    "input_image": "images need a vision model, and none is served here",
    "input_file": "files are not read by this server",
    "input_audio": "audio is not read by this server",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class InputPart(Body):
    """A content part of a message (or of a function_call_output's output)."""

    type: str = Field(examples=["input_text", "output_text", "refusal", "input_image"])
    text: str | None = None
    refusal: str | None = None


class InputItem(Body):
    """An input item of any type: the fields the served types read, each checked by type
    before any is used; the rest (ids, a reasoning item's summary) ride along."""

    type: str = Field(
        "message", examples=["message", "function_call", "function_call_output", "reasoning"]
    )
    role: str | None = Field(None, examples=["user", "assistant", "system", "developer"])
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class ToolDef(Body):
    type: str = Field(examples=["function", "web_search"])
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(Body):
    type: str = Field(examples=["function"])
    name: str | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # accepted: every prompt's prefix is cached anyway
    service_tier: str | None = None
    truncation: str | None = None
    # Refused unless unset: what they ask for is not served here.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt: Any = None

    def reject_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise InvalidRequest(f"previous_response_id: {_NO_STATE}", param="previous_response_id")
        if self.store:
            raise InvalidRequest(f"store: {_NO_STATE}", param="store")
        if self.conversation is not None:
            raise InvalidRequest(f"conversation: {_NO_STATE}", param="conversation")
        refused = {
            "background": (bool(self.background), "responses are served while you wait"),
            "include": (bool(self.include), "no extra output data is kept or encrypted"),
            "reasoning": (
                bool(self.reasoning and self.reasoning.get("effort")),
                "how long a model reasons is its own (and its template's) choice",
            ),
            "max_tool_calls": (self.max_tool_calls is not None, "calls are not counted"),
            "top_logprobs": (bool(self.top_logprobs), "use /v1/chat/completions for logprobs"),
            "prompt": (self.prompt is not None, "no prompt templates are stored here"),
            "truncation": (
                self.truncation not in (None, "disabled"),
                "an input longer than the context is refused, never truncated",
            ),
            "service_tier": (
                self.service_tier not in (None, "auto", "default"),
                "there is one service tier",
            ),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise NotImplementedField(name, why)


def to_chat(body: ResponsesRequest, max_depth: int = 64) -> ChatCompletionRequest:
    """The internal chat request ``body`` means; a 400 naming the field if it means none.
    JSON text in it (a function call's arguments) may nest ``max_depth`` levels."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _items(body.input, max_depth)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("input: give at least one message", param="input")
    first = next(m for m in messages if m["role"] != "system")
    if first["role"] != "user":
        raise InvalidRequest(
            f"input: the conversation must start with a user message, not an {first['role']} turn",
            param="input",
        )
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    tools = [_tool(i, t) for i, t in enumerate(body.tools or [])]
    if tools:
        fields["tools"] = tools
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    for ours, theirs in (
        ("max_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        if getattr(body, theirs) is not None:
            fields[ours] = getattr(body, theirs)
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        fields["response_format"] = _response_format(fmt)
    chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, fields)
    return chat


def _items(items: list[InputItem], max_depth: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.type
        if kind == "message":
            out.append(_message(item, param))
        elif kind == "function_call":
            call = _function_call(item, param, max_depth)
            calls.add(call["id"])
            if out and out[-1]["role"] == "assistant":  # calls made in one turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, param, calls))
        elif kind != "reasoning":
            raise NotImplementedField(
                f"{param}.type",
                f"input items of type {kind!r}: only "
                "message, function_call, function_call_output and "
                "reasoning items are served",
            )
    return out


def _message(item: InputItem, param: str) -> dict[str, Any]:
    role = item.role
    if role not in ("system", "developer", "user", "assistant"):
        raise InvalidRequest(
            f"{param}.role must be 'system', 'developer', 'user' or 'assistant', not {role!r}",
            param=f"{param}.role",
        )
    role = "system" if role == "developer" else role  # what chat templates know it as
    return {"role": role, "content": _text(item.content, f"{param}.content")}


def _text(content: str | list[InputPart] | None, param: str) -> str:
    """A message's content (or a call output) as text; 400 naming a part that is not."""
    if isinstance(content, str):
        return content
    if content is None:
        raise InvalidRequest(f"{param} must be a string or a list of content parts", param=param)
    text = ""
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.type
        if kind in _UNREADABLE_PARTS:
            raise InvalidRequest(
                f"{where}: content parts of type '{kind}' are not supported: "
                f"{_UNREADABLE_PARTS[kind]}",
                param=f"{where}.type",
            )
        value = part.text if part.text is not None else part.refusal
        if kind not in _TEXT_PARTS or value is None:
            raise InvalidRequest(
                f"{where}: expected a text part ({', '.join(_TEXT_PARTS[:2])} "
                f"with a 'text' string), got type {kind!r}",
                param=f"{where}.type",
            )
        text += value
    return text


def _function_call(item: InputItem, param: str, max_depth: int) -> dict[str, Any]:
    fields = {k: getattr(item, k) for k in ("call_id", "name", "arguments")}
    for name, value in fields.items():
        if not isinstance(value, str):
            raise InvalidRequest(f"{param}.{name} must be a string", param=f"{param}.{name}")
    try:  # checked here, to name the field as this API does
        decode_json_text(fields["arguments"], max_depth, f"{param}.arguments")
    except ValueError as e:
        raise InvalidRequest(
            f"{param}.arguments must be JSON text", param=f"{param}.arguments"
        ) from e
    return {
        "id": fields["call_id"],
        "type": "function",
        "function": {"name": fields["name"], "arguments": fields["arguments"]},
    }


def _call_output(item: InputItem, param: str, calls: set[str]) -> dict[str, Any]:
    call_id = item.call_id
    if call_id is None:
        raise InvalidRequest(f"{param}.call_id must be a string", param=f"{param}.call_id")
    if call_id not in calls:
        raise InvalidRequest(
            f"{param}: function_call_output's call_id {call_id!r} matches no "
            "earlier function_call item",
            param=f"{param}.call_id",
        )
    return {
        "role": "tool",
        "tool_call_id": call_id,
        "content": _text(item.output, f"{param}.output"),
    }


def _tool(i: int, tool: ToolDef) -> dict[str, Any]:
    if tool.type != "function":
        raise NotImplementedField(
            f"tools[{i}].type",
            f"tools of type {tool.type!r}: only "
            "function tools are served (built-in tools run on OpenAI's "
            "servers)",
        )
    if tool.name is None:
        raise InvalidRequest(
            f"tools[{i}].name: a function tool needs a name", param=f"tools[{i}].name"
        )
    function = tool.model_dump(include={"name", "description", "parameters"}, exclude_none=True)
    return {"type": "function", "function": function}


def _tool_choice(choice: str | NamedChoice) -> str | dict[str, Any]:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, NamedChoice) and choice.type == "function" and choice.name is not None:
        return {"type": "function", "function": {"name": choice.name}}
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema" and isinstance(fmt, dict):
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise InvalidRequest(
        "text.format.type must be 'text', 'json_object' or 'json_schema'", param="text.format.type"
    )
