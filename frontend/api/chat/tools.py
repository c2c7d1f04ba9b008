"""Tool calling in chat: what the template renders, what constrains the output, and how
the output becomes ``tool_calls``.

``tool_choice``           the output                          parsed by
    none (or no tools)    free text                           nothing: it is content
    auto (the default)    free text, maybe calls              ``--tool-call-parser``
    required              a JSON array of {name, parameters}  RequiredCalls
                          (a JSON-schema grammar: one of the tools, its parameters' schema)
    {"type": "function",  that function's arguments object    NamedCall
     "function": {name}}  (a JSON-schema grammar: its parameters)
``required`` and a named choice are enforced with structured output, so the call always
parses, whatever the model (a random one included), unless ``max_tokens`` cuts it short.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from frontend.api.chat.tool_parsers import (
    PARSERS,
    CallArgs,
    CallStart,
    Content,
    NamedCall,
    RequiredCalls,
    ToolParser,
)
from frontend.api.common.protocol import ChatTool
from frontend.api.common.schema_checks import check_satisfiable
from frontend.api.common.structured import check_enforceable
from frontend.errors import InvalidRequest, NotImplementedField
from wire.params import GrammarKind, GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tools``/``tool_choice`` mean for this request."""

    template_tools: list[dict[str, Any]] | None = None  # for apply_chat_template(tools=)
    grammar: GrammarSpec | None = None  # required / named: the output's shape
    parser: Callable[[], ToolParser] | None = None  # None: the output is content
    named: bool = False  # a named choice finishes "stop", as OpenAI's does

    @property
    def parses(self) -> bool:
        return self.parser is not None


def plan_tools(body: Any, parser_name: str | None) -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400s that say what is wrong) and plan them."""
    if body.functions or body.function_call not in (None, "none"):
        raise NotImplementedField("functions", "use 'tools' and 'tool_choice' instead")
    tools = [_checked_tool(i, t) for i, t in enumerate(body.tools or [])]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan(template_tools=tools or None)
    if not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        if parser_name is None:
            raise InvalidRequest(
                "tool_choice 'auto' needs the server started with --tool-call-parser",
                param="tool_choice",
            )
        return ToolPlan(tools, parser=PARSERS[parser_name])
    if choice == "required":
        return ToolPlan(tools, _required_grammar(tools, body.parallel_tool_calls), RequiredCalls)
    name = _named(choice)
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    params = _parameters(tool)
    spec = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(params))
    return ToolPlan(tools, spec, lambda: NamedCall(name), named=True)


def _checked_tool(i: int, tool: ChatTool) -> dict[str, Any]:
    param = f"tools[{i}]"
    if tool.type != "function":
        raise NotImplementedField(f"{param}.type", "only tools of type 'function' are implemented")
    if tool.function is None or not _NAME.match(tool.function.name):
        raise InvalidRequest(
            "a function needs a name of 1-64 letters, digits, _ or -",
            param=f"{param}.function.name",
        )
    fn = tool.function.model_dump(exclude_none=True)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    check_satisfiable(params, f"{param}.function.parameters")
    check_enforceable(params, f"{param}.function.parameters")
    return {"type": "function", "function": {**fn, "parameters": params}}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = tool["function"]["parameters"]
    return params


def _named(choice: Any) -> str:
    ok = isinstance(choice, dict) and choice.get("type") == "function"
    fn = choice.get("function") if ok else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return str(fn["name"])


def _required_grammar(tools: list[dict[str, Any]], parallel: bool | None) -> GrammarSpec:
    """Calls as a JSON array: each item one of the tools, by name, with its parameters."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": {"$ref": f"#/$defs/tool_{i}"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    # Each tool's parameters sit under $defs, their local $refs made to point there.
    defs = {f"tool_{i}": _rebased(_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    schema: dict[str, Any] = {
        "$defs": defs,
        "type": "array",
        "items": {"anyOf": items},
        "minItems": 1,
    }
    if parallel is False:
        schema["maxItems"] = 1
    return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(schema))


_DATA = ("const", "enum", "default", "examples")  # values, not schemas: never rebased
_NAMED = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every local '$ref' ('#', '#/$defs/x') made relative to ``base``."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA else _rebased(v, base) for k, v in schema.items()}
    for key in _NAMED:  # their keys are names, not keywords: a property may be "enum"
        if isinstance(schema.get(key), dict):
            out[key] = {name: _rebased(sub, base) for name, sub in schema[key].items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_output(parser: ToolParser, text: str) -> ParsedOutput:
    """A whole output as OpenAI's message fields."""
    content, calls = "", []
    args: list[str] = []  # per call
    for ev in [*parser.feed(text), *parser.finish()]:
        if isinstance(ev, Content):
            content += ev.text
        elif isinstance(ev, CallStart):
            calls.append(ev.name)
            args.append("")
        elif isinstance(ev, CallArgs):
            args[-1] += ev.text
    tool_calls = [
        {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": a}}
        for name, a in zip(calls, args, strict=True)
    ]
    return ParsedOutput(content if content or not calls else None, tool_calls)


class ToolCallDeltas:
    """Parser events -> ``delta`` fields of chat chunks, as OpenAI streams tool calls: a
    call's first delta has its index, id, type and name; the next ones carry fragments
    of ``function.arguments`` under the same index."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        delta: dict[str, Any] = {}
        calls: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, Content):
                delta["content"] = delta.get("content", "") + ev.text
            elif isinstance(ev, CallStart):
                calls.append(
                    {
                        "index": self.num_calls,
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": ev.name, "arguments": ""},
                    }
                )
                self.num_calls += 1
            elif isinstance(ev, CallArgs):
                if calls and calls[-1]["index"] == self.num_calls - 1:
                    calls[-1]["function"]["arguments"] += ev.text
                else:
                    calls.append({"index": self.num_calls - 1, "function": {"arguments": ev.text}})
        if calls:
            delta["tool_calls"] = calls
        return delta
