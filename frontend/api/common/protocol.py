"""Request bodies of the HTTP API and their translation into engine parameters.

Pydantic models in strict mode: ``"1"`` is not an int and ``1`` is not a bool. Every
OpenAI field we know of is either implemented or rejected with a 400 that names it
(``reject_unsupported``); fields nobody knows are ignored and logged by the handler.
``to_engine_params`` is the single place where a body becomes ``SamplingParams`` +
``DetokParams``; its range checks are ``SamplingParams.validate``'s.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from frontend.errors import InvalidRequest, NotImplementedField, field_path
from wire.params import DetokParams, GrammarSpec, ReasoningMode, SamplingParams

# NOTE: these caps keep every record a request becomes within the smallest ring it
# crosses (a detokenizer control ring holds 256 KiB; see launcher/topology.py). Without
# them one request could make a record no ring can carry and fail or kill a worker.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class Body(BaseModel):
    """Strict: a JSON string is no number, a number no bool; unknown fields are kept for
    the handler to log."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Body):
    """Options shared by /v1/completions, /v1/chat/completions and /generate."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Opt-in: usage.completion_tokens_details gets accepted_prediction_tokens and
    # rejected_prediction_tokens, speculation's drafts (docs/speculative.md).
    return_prediction_tokens_details: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidRequest(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
        return tuple(stops)

    def checked_stop_token_ids(self) -> tuple[int, ...]:
        ids = tuple(self.stop_token_ids or ())
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids"
            )
        return ids


class OpenAIFields(SamplingFields):
    """Fields common to both OpenAI endpoints, including the ones we reject."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False
    # Structured output (frontend/api/common/structured.py): OpenAI's, vLLM's current and older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def reject_common(self) -> None:
        if self.logit_bias:
            raise NotImplementedField("logit_bias", "logit biasing is not implemented")
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequest("stream_options requires stream=true", param="stream_options")
            if self.stream_options.continuous_usage_stats:
                raise NotImplementedField(
                    "stream_options.continuous_usage_stats", "usage is sent once, at the end"
                )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAIFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def reject_unsupported(self) -> None:
        self.reject_common()
        if self.echo and self.logprobs is not None:
            raise NotImplementedField(
                "echo", "echo with logprobs needs prompt logprobs, which are not computed"
            )
        if self.suffix:
            raise NotImplementedField("suffix", "insertion (suffix) is not implemented")
        nested = isinstance(self.prompt, list) and not isinstance(next(iter(self.prompt), 0), int)
        if nested and len(self.prompt) != 1:
            raise NotImplementedField("prompt", "one prompt per request, not a batch")


class ContentPart(Body):
    type: str = Field(examples=["text", "image_url"])
    text: str | None = None


class ToolCallFunction(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(Body):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise NotImplementedField(
                    f"messages[{index}].content", f"content part type '{part.type}'"
                )
            parts.append(part.text)
        return "".join(parts)


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Body):
    """A tool as it arrives; ``frontend/api/chat/tools.py`` refuses types other than
    ``function`` and checks the function."""

    type: str = Field(examples=["function", "code_interpreter"])
    function: FunctionDef | None = None


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last message
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked by frontend/api/chat/tools.py
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    def reject_unsupported(self) -> None:
        self.reject_common()
        if not self.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if self.continue_final_message and (
            self.add_generation_prompt or self.messages[-1].role != "assistant"
        ):
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt=false "
                "and an assistant message last",
                param="continue_final_message",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class NativeSampling(SamplingFields):
    max_new_tokens: int | None = None
    max_tokens: int | None = None
    logprobs: int | None = None


class NativeGenerateRequest(Body):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = NativeSampling()
    stream: bool = False

    def reject_unsupported(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("give exactly one of 'text' and 'input_ids'", param="text")


def parse_body(model: type[BaseModel], obj: object, prefix: str = "") -> Any:
    """Validate a decoded JSON body (or, under ``prefix``, a part of one); a
    ``ValidationError`` becomes a 400 naming the field's path (``messages[2].content``)."""
    if not isinstance(obj, dict):
        what = f"'{prefix}'" if prefix else "the request body"
        raise InvalidRequest(f"{what} must be a JSON object", param=prefix or None)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        param, message = _first_error(e, prefix)
        raise InvalidRequest(f"Invalid value for '{param}': {message}", param=param) from e


def _first_error(e: ValidationError, prefix: str) -> tuple[str, str]:
    """The deepest failing field's path, and what is wrong there. A union's members fail
    at one path each ("a valid string", "a valid list"): their messages are joined."""
    found: dict[str, list[str]] = {}
    for err in e.errors():
        # Union members appear in ``loc`` as type names ("list[int]"); they are noise.
        loc = [p for p in err["loc"] if isinstance(p, int) or _is_field_name(p)]
        if err["type"] == "union_tag_invalid":
            loc.append("type")
        path = field_path([prefix, *loc] if prefix else loc) or "body"
        found.setdefault(path, [])
        if err["msg"] not in found[path]:
            found[path].append(err["msg"])
    path = max(found, key=lambda p: (p.count(".") + p.count("["), -list(found).index(p)))
    return path, " or ".join(found[path])


def _is_field_name(part: object) -> bool:
    return isinstance(part, str) and "[" not in part and part not in _TYPE_NAMES


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise InvalidRequest("the prompt is empty", param=param)
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param=param)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """The output budget: ``requested`` if it fits the context window, else a 400."""
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {prompt_len}. Shorten the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise InvalidRequest("max_tokens must be >= 1", param="max_tokens")
    if prompt_len + requested > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} to generate). "
            "Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def to_engine_params(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    max_logprobs: int,
    grammar: GrammarSpec | None = None,
    reasoning: ReasoningMode = ReasoningMode.OFF,
) -> tuple[SamplingParams, DetokParams]:
    """Translate validated fields into the engine's and the detokenizer's parameters."""
    defaults = SamplingParams()
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_pick(body.temperature, defaults.temperature),
        top_p=_pick(body.top_p, defaults.top_p),
        # Any k beyond the vocabulary keeps every token; clamping keeps it in int64 too.
        top_k=min(_pick(body.top_k, defaults.top_k), vocab_size),
        min_p=_pick(body.min_p, defaults.min_p),
        repetition_penalty=_pick(body.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_pick(body.presence_penalty, defaults.presence_penalty),
        frequency_penalty=_pick(body.frequency_penalty, defaults.frequency_penalty),
        seed=body.seed,
        stop_token_ids=body.checked_stop_token_ids(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        grammar=grammar,
    )
    try:
        sampling.validate(vocab_size, max_logprobs)
    except ValueError as e:
        message = str(e)
        raise InvalidRequest(message, param=message.split(" ", 1)[0]) from e
    detok = DetokParams(
        stop=body.stop_strings(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        stop_token_ids=tuple(sampling.stop_token_ids),
        reasoning=reasoning,
        count_drafts=body.return_prediction_tokens_details,
    )
    return sampling, detok


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def to_json(obj: object) -> bytes:
    return msgspec.json.encode(obj)


class TokenizeRequest(Body):
    """POST /tokenize, as vLLM shapes it: a ``prompt``, or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def reject_unsupported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' and 'messages'", param="prompt")


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
