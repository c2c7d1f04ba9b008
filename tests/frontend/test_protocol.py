"""Request validation: every rejection names its field; valid bodies map to engine params."""

from __future__ import annotations

from typing import Any

import pytest

from frontend.api.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
    check_prompt_ids,
    parse_body,
    resolve_max_tokens,
    to_engine_params,
)
from frontend.errors import InvalidRequest, NotImplementedField

VOCAB = 1000


def completion(**fields: Any) -> CompletionRequest:
    req = parse_body(CompletionRequest, {"prompt": "hi", **fields})
    assert isinstance(req, CompletionRequest)
    return req


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    req = parse_body(ChatCompletionRequest, body)
    assert isinstance(req, ChatCompletionRequest)
    return req


def engine_params(req: CompletionRequest, max_tokens: int = 8) -> Any:
    return to_engine_params(req, max_tokens, req.logprobs, VOCAB, 20)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "1"),
        ("max_tokens", 1.5),
        ("max_tokens", "16"),
        ("stream", "true"),
        ("stream", 1),
        ("top_k", 2.0),
        ("seed", True),
        ("stop", 3),
        ("stop_token_ids", [1, "2"]),
        ("prompt", True),
        ("prompt", [1, "a"]),
        ("temperature", float("nan")),
        ("logprobs", "2"),
    ],
)
def test_wrong_types_are_rejected_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        completion(**{field: value})
    assert info.value.param is not None and info.value.param.startswith(field)
    assert info.value.status == 400


def test_body_must_be_a_json_object() -> None:
    with pytest.raises(InvalidRequest):
        parse_body(CompletionRequest, [1, 2])


def test_missing_required_field_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_body(CompletionRequest, {"max_tokens": 3})
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "tail"}, "suffix"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_unimplemented_completion_fields_are_rejected(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(NotImplementedField) as info:
        completion(**fields).reject_unsupported()
    assert info.value.param == param
    assert "not supported" in info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
    ],
)
def test_unimplemented_chat_fields_are_rejected(fields: dict[str, Any], param: str) -> None:
    req = chat(**fields)
    with pytest.raises(NotImplementedField) as info:
        req.reject_unsupported()
        for i, m in enumerate(req.messages):
            m.text(i)
    assert info.value.param == param


def test_accepted_defaults_of_rejectable_fields_pass() -> None:
    completion(n=1, best_of=1, echo=False, suffix=None, logit_bias={}).reject_unsupported()
    chat(n=1, tool_choice="none", response_format={"type": "text"}).reject_unsupported()


def test_chat_consistency_rules() -> None:
    with pytest.raises(InvalidRequest, match="top_logprobs requires logprobs"):
        chat(top_logprobs=3).reject_unsupported()
    with pytest.raises(InvalidRequest, match="messages must not be empty"):
        chat(messages=[]).reject_unsupported()
    with pytest.raises(InvalidRequest) as info:
        chat(messages=[{"role": "wizard", "content": "x"}])
    assert info.value.param == "messages[0].role"


def test_stream_options_require_stream() -> None:
    with pytest.raises(InvalidRequest) as info:
        completion(stream_options={"include_usage": True}).reject_unsupported()
    assert info.value.param == "stream_options"


def test_unknown_fields_are_kept_aside_not_rejected() -> None:
    req = completion(frobnicate=1, another="x")
    assert req.unknown_fields() == ["another", "frobnicate"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 101}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
    ],
)
def test_out_of_range_values_are_rejected(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        engine_params(completion(**fields))
    assert info.value.param == param


def test_fields_map_onto_engine_and_detokenizer_params() -> None:
    req = completion(
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=7,
        stop="END",
        stop_token_ids=[3],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    sampling, detok = engine_params(req, max_tokens=9)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (
        9,
        0.5,
        0.9,
        5,
    )
    assert (sampling.min_p, sampling.seed, sampling.stop_token_ids) == (0.1, 7, (3,))
    assert sampling.ignore_eos and sampling.logprobs == 2
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert sampling.repetition_penalty == 1.2
    assert detok.stop == ("END",) and detok.include_stop_str_in_output
    assert not detok.skip_special_tokens


def test_omitted_fields_take_engine_defaults() -> None:
    sampling, detok = engine_params(completion(temperature=None))
    assert sampling.temperature == 1.0 and sampling.top_k == 0 and sampling.logprobs is None
    assert detok.stop == () and detok.skip_special_tokens


def test_top_k_beyond_the_vocabulary_means_all_tokens() -> None:
    sampling, _ = engine_params(completion(top_k=10**30))
    assert sampling.top_k == VOCAB


def test_max_tokens_must_fit_the_context_window() -> None:
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(90, 10, 100) == 90
    with pytest.raises(InvalidRequest) as info:
        resolve_max_tokens(91, 10, 100)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as info:
        resolve_max_tokens(None, 100, 100)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest):
        resolve_max_tokens(0, 1, 100)


def test_prompt_ids_must_be_non_empty_and_in_vocabulary() -> None:
    check_prompt_ids([0, VOCAB - 1], VOCAB, "prompt")
    for bad in ([], [VOCAB], [-1]):
        with pytest.raises(InvalidRequest):
            check_prompt_ids(bad, VOCAB, "prompt")


def test_native_generate_needs_exactly_one_input() -> None:
    for body in ({}, {"text": "a", "input_ids": [1]}):
        req = parse_body(NativeGenerateRequest, body)
        with pytest.raises(InvalidRequest):
            req.reject_unsupported()
    parse_body(NativeGenerateRequest, {"input_ids": [1, 2]}).reject_unsupported()
