"""Bad requests against the launched server get OpenAI-shaped 4xx errors (issue 7).

Raw HTTP (httpx), so the bytes on the wire are exactly the ones a broken client sends.
The last tests pin what must hold after all of that: the server still serves, every
worker is alive, and a client that walks away mid-stream has its KV freed at once.

Overload (503 + Retry-After, OpenAI error shape) is pinned by tests/e2e/test_overload.py,
on a server of its own with a small admission bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from frontend.settings import DEFAULT_MAX_BODY_BYTES
from tests.conftest import LaunchedServer
from tests.e2e.helpers import read_events_then_leave, wait_kv_free

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
MESSAGES = [{"role": "user", "content": "Hi"}]
MAX_MODEL_LEN = 1024  # the `server` fixture's --max-model-len


@pytest.fixture(scope="module")
def http(server: LaunchedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    """A valid small request for ``path`` with ``fields`` merged in (None removes one)."""
    base: dict[str, Any]
    if path == COMPLETIONS:
        base = {"prompt": "Hello", "max_tokens": 2}
    elif path == CHAT:
        base = {"messages": MESSAGES, "max_tokens": 2}
    else:
        base = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    merged = {**base, **fields}
    return {k: v for k, v in merged.items() if v is not None}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    return str(error["message"])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, GENERATE])
@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b'{"prompt": "a",}',
        b"not json",
        b"",
        b'{"prompt": "\\ud800"}',
        b"[" * 10_000,
        b'{"temperature": NaN}',
        b'{"prompt": "a\xff", "max_tokens": 4}',
    ],
)
def test_malformed_json_is_a_400(http: httpx.Client, path: str, raw: bytes) -> None:
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert "JSON" in assert_openai_error(r, 400)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, GENERATE])
@pytest.mark.parametrize("doc", [[], "text", 3, None])
def test_body_that_is_not_an_object_is_a_400(http: httpx.Client, path: str, doc: Any) -> None:
    # Encoded here: httpx's json=None sends no body (and no Content-Type) at all.
    raw = json.dumps(doc).encode()
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        # values of the wrong type
        (COMPLETIONS, {"max_tokens": "2"}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": 2.5}, "max_tokens"),
        (COMPLETIONS, {"temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": 12}, "prompt"),
        (COMPLETIONS, {"prompt": None}, "prompt"),
        (COMPLETIONS, {"stream": "yes"}, "stream"),
        (COMPLETIONS, {"stop": [1, 2]}, "stop"),
        (COMPLETIONS, {"logprobs": True}, "logprobs"),
        (CHAT, {"messages": "Hi"}, "messages"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
        (CHAT, {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
        (CHAT, {"stream_options": [1]}, "stream_options"),
        (GENERATE, {"input_ids": ["a"], "text": None}, "input_ids"),
        (GENERATE, {"sampling_params": {"max_new_tokens": "2"}}, "sampling_params"),
        # values of the right type, out of range
        (COMPLETIONS, {"temperature": -1}, "temperature"),
        (COMPLETIONS, {"top_p": 0}, "top_p"),
        (COMPLETIONS, {"top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"top_k": -5}, "top_k"),
        (COMPLETIONS, {"min_p": 2}, "min_p"),
        (COMPLETIONS, {"presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"frequency_penalty": -2.5}, "frequency_penalty"),
        (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"seed": 2**64}, "seed"),
        (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids"),
        (COMPLETIONS, {"stop_token_ids": [10**9]}, "stop_token_ids"),
        (COMPLETIONS, {"stop_token_ids": [1] * 1025}, "stop_token_ids"),
        (COMPLETIONS, {"stop": ""}, "stop"),
        (COMPLETIONS, {"stop": ["s"] * 17}, "stop"),
        (COMPLETIONS, {"stop": ["x" * 30_000] * 16}, "stop"),
        (COMPLETIONS, {"prompt": [10**9]}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 50}, "logprobs"),
        (CHAT, {"max_completion_tokens": 0}, "max_tokens"),
        (GENERATE, {"input_ids": [], "text": None}, "input_ids"),
        (GENERATE, {"input_ids": [1], "text": "both"}, "text"),
        (GENERATE, {"sampling_params": {"max_new_tokens": 2, "max_tokens": 2}}, "max_tokens"),
        (GENERATE, {"sampling_params": {"max_new_tokens": 2, "temperature": 500}}, "temperature"),
    ],
)
def test_wrong_types_and_out_of_range_values_are_a_400_naming_the_field(
    http: httpx.Client, path: str, fields: dict[str, Any], param: str
) -> None:
    r = http.post(path, json=body_for(path, **fields))
    assert_openai_error(r, 400, param)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"prompt": [1] * 1000, "max_tokens": 25}, "max_tokens"),
        (COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt"),
        (COMPLETIONS, {"prompt": "hello " * 2000}, "prompt"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi " * 500}], "max_tokens": 600},
            "max_tokens",
        ),
        (
            GENERATE,
            {"input_ids": [1] * 1000, "text": None, "sampling_params": {"max_new_tokens": 100}},
            "max_tokens",
        ),
    ],
)
def test_prompt_beyond_the_context_window_is_a_400(
    http: httpx.Client, path: str, fields: dict[str, Any], param: str
) -> None:
    r = http.post(path, json=body_for(path, **fields))
    assert "maximum context length" in assert_openai_error(r, 400, param)
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model_is_a_404(http: httpx.Client, path: str) -> None:
    r = http.post(path, json=body_for(path, model="gpt-4o"))
    assert "gpt-4o" in assert_openai_error(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"suffix": "tail"}, "suffix"),
        (COMPLETIONS, {"echo": True, "logprobs": 2}, "echo"),
        (COMPLETIONS, {"logit_bias": {"1": 5.0}}, "logit_bias"),
        (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
        (CHAT, {"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (
            CHAT,
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_unimplemented_fields_are_a_400_naming_the_field(
    http: httpx.Client, path: str, fields: dict[str, Any], param: str
) -> None:
    r = http.post(path, json=body_for(path, **fields))
    assert f"'{param}" in assert_openai_error(r, 400, param)
    assert r.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, GENERATE])
def test_body_over_the_limit_is_a_413(http: httpx.Client, path: str) -> None:
    big = body_for(path, padding="x" * DEFAULT_MAX_BODY_BYTES)
    assert_openai_error(http.post(path, json=big), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"padding": "'
        for _ in range(DEFAULT_MAX_BODY_BYTES // 65_536 + 1):
            yield b"y" * 65_536
        yield b'"}'

    json_type = {"content-type": "application/json"}
    assert_openai_error(http.post(path, content=chunked(), headers=json_type), 413)


def test_unknown_route_and_wrong_method_keep_the_error_shape(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/embeddings", json={}), 404)
    assert_openai_error(http.get(COMPLETIONS), 405)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_client_gone_mid_stream_frees_kv_within_a_second(
    http: httpx.Client, server: LaunchedServer, path: str
) -> None:
    body = body_for(path, max_tokens=800, ignore_eos=True, stream=True, temperature=0)
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        read_events_then_leave(server, r)
    # Leaving the `with` closed the connection: the server must notice and free the KV.
    wait_kv_free(server, 1.0)


def test_server_still_serves_after_the_error_suite(
    http: httpx.Client, server: LaunchedServer
) -> None:
    for path in (COMPLETIONS, CHAT, GENERATE):
        r = http.post(path, json=body_for(path))
        assert r.status_code == 200, r.text
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    workers = health.json()["workers"]
    assert {w["role"] for w in workers} == {"prefill", "decode", "detokenizer", "frontend"}
    assert len(workers) == 7 and all(w["alive"] for w in workers)
