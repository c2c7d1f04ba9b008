"""HTTP fuzzing of the launched server (issue 9): no body makes a 5xx or kills a worker.

Hypothesis builds JSON bodies field by field: each known field gets either a plausible
value (often valid, often just out of range) or arbitrary JSON, and unknown fields ride
along. Every answer must be a 2xx or an OpenAI-shaped 4xx; streamed answers must not
carry a server error event; and afterwards every worker must be the same live process
as before (the launcher restarts dead ones, so liveness alone would hide a crash).

These strategies are written by hand, field by field; ``test_schema_fuzz.py`` generates
bodies for every endpoint from the request schemas the app serves in /openapi.json.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from hypothesis import event, given, settings
from hypothesis import strategies as st

from benchmarks.serving.api_fuzz import any_json
from tests.conftest import LaunchedServer
from tests.e2e.helpers import E2E_FUZZ

FUZZ = E2E_FUZZ
VOCAB = 151_936


def edgy(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value (7 in 8), sometimes one just out of range."""
    return st.one_of(*[valid] * 7, edge)


def wild(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes arbitrary JSON of any type."""
    return st.one_of(plausible, plausible, plausible, any_json)


vocab_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
token_ids = edgy(vocab_ids, st.lists(st.integers(-3, VOCAB + 3), max_size=12))
stop = edgy(
    st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    st.lists(st.text(max_size=3), max_size=18)
    | st.lists(st.text(min_size=1, max_size=3).map(lambda s: s * 400), max_size=2),
)
SAMPLING = {
    "temperature": edgy(st.floats(0, 2) | st.sampled_from([0, 1]), st.floats(-1, 200)),
    "top_p": edgy(st.floats(0.01, 1), st.floats(-0.1, 1.2)),
    "top_k": edgy(st.integers(-1, 50), st.integers(-3, 2**70)),
    "min_p": edgy(st.floats(0, 1), st.floats(-0.1, 1.1)),
    "seed": edgy(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**65), 2**65)),
    "stop": stop,
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "presence_penalty": edgy(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": edgy(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": edgy(st.floats(0.1, 2), st.floats(-0.5, 11)),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
OPENAI = {
    **SAMPLING,
    "model": st.just("tiny-qwen2-v1"),
    "stream": st.booleans(),
    "user": st.text(max_size=8),
    "return_token_ids": st.booleans(),
}
# Known fields whose features are not implemented (400 when set to a non-default), and
# arbitrary unknown ones (ignored): only in wild bodies.
UNIMPLEMENTED = {
    "n": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2),
    "model": st.sampled_from(["tiny-qwen2-v1", "gpt-4"]),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "unknown_field": any_json,
}
# NOTE: the output budget is always present and never null: a null asks for the whole
# context window, and the fuzz run must stay short.
BUDGET = st.integers(-1, 6)
prompt = edgy(
    st.text(min_size=1, max_size=30) | vocab_ids | st.lists(vocab_ids, min_size=1, max_size=1),
    st.lists(st.text(max_size=8), max_size=2) | st.lists(token_ids, max_size=2) | st.just(""),
)
content_part = st.fixed_dictionaries(
    {"type": edgy(st.just("text"), st.just("image_url"))}, optional={"text": st.text(max_size=10)}
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.text(max_size=20) | st.lists(content_part, max_size=2) | st.none(),
    },
    optional={"name": st.text(max_size=5)},
)
ENDPOINTS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # path: (required fields, optional fields, fields only wild bodies carry)
    "/v1/completions": (
        {"max_tokens": BUDGET, "prompt": prompt},
        {**OPENAI, "logprobs": edgy(st.integers(0, 5), st.integers(-1, 22))},
        {
            **UNIMPLEMENTED,
            "echo": st.booleans(),
            "best_of": st.integers(0, 3),
            "suffix": st.text(max_size=4),
        },
    ),
    "/v1/chat/completions": (
        {"max_tokens": BUDGET, "messages": st.lists(message, min_size=1, max_size=3)},
        {
            **OPENAI,
            "max_completion_tokens": BUDGET,
            "logprobs": st.booleans(),
            "top_logprobs": edgy(st.integers(0, 5), st.integers(-1, 22)),
            "add_generation_prompt": st.booleans(),
        },
        {
            **UNIMPLEMENTED,
            "tools": st.lists(any_json, max_size=1),
            "tool_choice": st.sampled_from(["none", "auto", "required"]),
            "response_format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema"])}
            ),
        },
    ),
}


def openai_body(path: str, is_wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    required, optional, extra = ENDPOINTS[path]
    if not is_wild:
        return st.fixed_dictionaries(required, optional=optional).flatmap(with_usage)
    loosen = {k: wild(v) for k, v in {**optional, **extra}.items() if k != "max_tokens"}
    fixed = {k: v if k == "max_tokens" else wild(v) for k, v in required.items()}
    return st.fixed_dictionaries(fixed, optional=loosen)


def with_usage(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A streamed tame body may also ask for usage (only streams may)."""
    if body.get("stream") is not True:
        return st.just(body)
    return st.just(body) | st.just({**body, "stream_options": {"include_usage": True}})


def generate_body(is_wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    sampling = {**SAMPLING, "logprobs": edgy(st.integers(0, 5), st.integers(-1, 22))}
    loosen = wild if is_wild else (lambda v: v)
    params = st.fixed_dictionaries(
        {"max_new_tokens": BUDGET}, optional={k: loosen(v) for k, v in sampling.items()}
    )
    source = edgy(
        st.fixed_dictionaries({"text": st.text(min_size=1, max_size=30)})
        | st.fixed_dictionaries({"input_ids": token_ids}),
        st.fixed_dictionaries(
            {}, optional={"text": loosen(st.text(max_size=5)), "input_ids": loosen(token_ids)}
        ),
    )
    rest = st.fixed_dictionaries(
        {"sampling_params": params}, optional={"stream": loosen(st.booleans())}
    )
    return st.tuples(source, rest).map(lambda parts: {**parts[0], **parts[1]})


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Tame bodies (mostly served) and wild ones (mostly refused), about half each."""
    if path == "/generate":
        return st.booleans().flatmap(generate_body)
    return st.booleans().flatmap(lambda is_wild: openai_body(path, is_wild))


def check_answer(r: httpx.Response) -> None:
    """A 2xx with a well-formed body, or a 4xx in OpenAI's error shape; never a 5xx."""
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many got through
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        return
    if not r.headers["content-type"].startswith("text/event-stream"):
        assert "error" not in r.json(), r.text
        return
    frames = [f for f in r.text.split("\n\n") if f]
    assert frames and frames[-1] == "data: [DONE]", frames[-3:]
    for frame in frames[:-1]:
        assert frame.startswith("data: "), frame
        assert "error" not in json.loads(frame[len("data: ") :]), frame


@FUZZ
@given(body=bodies("/v1/completions"))
def test_fuzzed_completions_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(http.post("/v1/completions", json=body))


@FUZZ
@given(body=bodies("/v1/chat/completions"))
def test_fuzzed_chat_completions_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(http.post("/v1/chat/completions", json=body))


@FUZZ
@given(body=bodies("/generate"))
def test_fuzzed_generate_never_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(http.post("/generate", json=body))


@settings(FUZZ, max_examples=30)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
    raw=st.binary(max_size=64) | any_json.map(lambda v: json.dumps(v).encode()),
)
def test_fuzzed_raw_bytes_are_a_400(http: httpx.Client, path: str, raw: bytes) -> None:
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_every_worker_survived_the_fuzzing(
    server: LaunchedServer, worker_pids: dict[tuple[str, int], int]
) -> None:
    health = server.health()
    assert health["status"] == "ok"
    assert {(w["role"], w["index"]): w["pid"] for w in health["workers"]} == worker_pids
    assert all(w["alive"] for w in health["workers"])
    # Every fuzzed request has been answered; the workers drop them within moments.
    deadline = time.monotonic() + 5
    while busy(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not busy(server), server.health()


def busy(server: LaunchedServer) -> bool:
    """Any worker still running a request or holding KV blocks."""
    for w in server.health()["workers"]:
        load = w["load"]
        if load.get("running_requests", 0) or load.get("waiting_requests", 0):
            return True
        if load.get("total_kv_blocks", 0) != load.get("free_kv_blocks", 0):
            return True
    return False
