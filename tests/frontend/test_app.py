"""The OpenAI-compatible app over a real (transformers) engine, through httpx's ASGI transport."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.frontend.conftest import MODEL, make_settings

pytestmark = pytest.mark.anyio


def sse_events(body: str) -> list[Any]:
    """The JSON payloads of an SSE body; asserts the framing and the final [DONE]."""
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


async def complete(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": MODEL, **body})


async def test_greedy_completion_returns_text_ids_and_usage(http: httpx.AsyncClient) -> None:
    engine = http._transport.app.state.engine  # type: ignore[attr-defined]
    r = await complete(
        http,
        prompt="Hello world",
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert choice["prompt_token_ids"] == engine.tokenizer.encode("Hello world")
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert choice["text"] == engine.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


async def test_streamed_text_equals_the_non_streamed_text(http: httpx.AsyncClient) -> None:
    common = dict(prompt="The quick brown fox", max_tokens=8, temperature=0, ignore_eos=True)
    whole = (await complete(http, **common)).json()["choices"][0]["text"]
    r = await complete(http, **common, stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


async def test_prompt_as_token_ids(http: httpx.AsyncClient) -> None:
    r = await complete(http, prompt=[9707, 1879], max_tokens=2, temperature=0, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2


async def test_stop_string_ends_output_before_it(http: httpx.AsyncClient) -> None:
    common = dict(prompt="Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
    full = (await complete(http, **common)).json()["choices"][0]["text"]
    stop = full[5:8]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    choice = (await complete(http, **common, stop=[stop])).json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    kept = (await complete(http, **common, stop=stop, include_stop_str_in_output=True)).json()
    assert kept["choices"][0]["text"] == full[: full.index(stop) + len(stop)]


async def test_stop_token_id_is_reported_as_stop_reason(http: httpx.AsyncClient) -> None:
    common = dict(
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
    )
    ids = (await complete(http, **common)).json()["choices"][0]["token_ids"]
    choice = (await complete(http, **common, stop_token_ids=[ids[2]])).json()["choices"][0]
    assert choice["token_ids"] == ids[: ids.index(ids[2]) + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[2])


async def test_completion_logprobs_have_openai_shape(http: httpx.AsyncClient) -> None:
    r = await complete(http, prompt="Hi", max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and token in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the argmax


async def test_chat_uses_the_tokenizer_template(http: httpx.AsyncClient) -> None:
    engine = http._transport.app.state.engine  # type: ignore[attr-defined]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = await http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_completion_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert body["prompt_token_ids"] == engine.tokenizer.encode(text, add_special_tokens=False)
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert choice["message"]["role"] == "assistant" and len(choice["token_ids"]) == 5
    content = choice["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())


async def test_chat_stream_starts_with_the_role_and_ends_with_usage(
    http: httpx.AsyncClient,
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events((await http.post("/v1/chat/completions", json=body)).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 4


async def _prompt_ids_of_hi(client: Any, chat_template: str) -> list[int]:
    """The prompt a chat of one "Hi" becomes under ``--chat-template chat_template``."""
    from frontend.http.app import build_app

    app = build_app(client, client.tokenizer, make_settings(chat_template=chat_template))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as h:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        r = await h.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    ids: list[int] = r.json()["prompt_token_ids"]
    return ids


async def test_chat_template_override_is_used(make_client: Any) -> None:
    client = make_client()
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[bot]"
    ids = await _prompt_ids_of_hi(client, template)
    assert ids == client.tokenizer.encode("[user]Hi[bot]")


async def test_chat_template_file_is_loaded(make_client: Any, tmp_path: Any) -> None:
    from frontend.http.app import build_app

    client = make_client()
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    ids = await _prompt_ids_of_hi(client, str(tmp_path / "t.jinja"))
    assert ids == client.tokenizer.encode("<Hi>")
    with pytest.raises(ValueError, match="neither a file"):
        build_app(client, client.tokenizer, make_settings(chat_template="/no/such/file"))


async def test_native_generate(http: httpx.AsyncClient) -> None:
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = await http.post("/generate", json={"text": "Hello", "sampling_params": sp})
    out = r.json()
    assert r.status_code == 200 and len(out["output_ids"]) == 5
    assert out["finish_reason"] == "length" and out["usage"]["prompt_tokens"] == 1
    r = await http.post(
        "/generate", json={"input_ids": [9707], "sampling_params": sp, "stream": True}
    )
    events = sse_events(r.text)
    assert "".join(e["text"] for e in events) == out["text"]
    assert sum(len(e["output_ids"]) for e in events) == 5 and events[-1]["usage"]


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens"),
        (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
        (b'{"prompt": "x", "n": 17}', 400, "n"),
        (b'{"prompt": "x", "max_tokens": 300}', 400, "max_tokens"),
        (b'{"prompt": [151936]}', 400, "prompt"),
        (b'{"prompt": ""}', 400, "prompt"),
        (b"[" * 100_000, 400, None),  # deep nesting must not blow the stack
        (b'{"prompt": "x", "stop": ["\\ud800"]}', 400, None),  # lone surrogate
        (b'{"prompt": "x", "temperature": NaN}', 400, None),
        (b"\xff\xfe{}", 400, None),
        (b'{"prompt": "a\xff", "max_tokens": 4}', 400, None),  # not UTF-8 inside a string
        (b'{"prompt\xed\xa0\x80": 1}', 400, None),  # an encoded surrogate in a key
    ],
)
async def test_bad_requests_get_openai_errors(
    http: httpx.AsyncClient, content: bytes, status: int, param: str | None
) -> None:
    r = await http.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


async def test_oversized_body_is_refused(http: httpx.AsyncClient) -> None:
    big = json.dumps({"prompt": "x" * (8 * 1024 * 1024)})
    r = await http.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_unknown_route_has_openai_error_shape(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]


async def test_unknown_fields_are_ignored_and_logged(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="frontend.http.app"):
        r = await complete(http, prompt="Hi", max_tokens=1, frobnicate=True)
    assert r.status_code == 200
    assert "frobnicate" in caplog.text


async def test_api_key_is_required_when_set(make_client: Any) -> None:
    from frontend.http.app import build_app

    client = make_client()
    app = build_app(client, client.tokenizer, make_settings(api_key="s3cret"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as h:
        body = {"prompt": "Hi", "max_tokens": 1}
        assert (await h.post("/v1/completions", json=body)).status_code == 401
        bad = {"authorization": "Bearer nope"}
        r = await h.post("/v1/completions", json=body, headers=bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await h.get("/v1/models")).status_code == 401
        good = {"authorization": "Bearer s3cret"}
        assert (await h.post("/v1/completions", json=body, headers=good)).status_code == 200
        assert (await h.get("/health")).status_code == 200  # probes need no key


async def test_overload_is_503_with_retry_after(make_client: Any) -> None:
    from frontend.http.app import build_app

    client = make_client(max_running=0)
    app = build_app(client, client.tokenizer, make_settings())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as h:
        r = await h.post("/v1/completions", json={"prompt": "Hi", "stream": True})
        metrics = (await h.get("/metrics")).text
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "overloaded"
    assert "pdserve_requests_refused_total 1.0" in metrics


async def test_under_overload_a_request_without_the_key_is_still_401(make_client: Any) -> None:
    from frontend.http.app import build_app

    client = make_client(max_running=0)
    app = build_app(client, client.tokenizer, make_settings(api_key="s3cret"))
    body = {"prompt": "Hi", "max_tokens": 1}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as h:
        for auth in (None, "Bearer wrong", "Basic s3cret"):
            headers = {} if auth is None else {"authorization": auth}
            r = await h.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401, auth
        for auth in ("Bearer s3cret", "bearer s3cret"):
            r = await h.post("/generate", json={"text": "Hi"}, headers={"authorization": auth})
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", auth
        assert (await h.get("/health")).status_code == 200


async def test_engine_failure_is_a_500_not_a_crash(http: httpx.AsyncClient) -> None:
    # The reference client refuses top_k, which it does not implement, with EngineUnavailable.
    r = await complete(http, prompt="Hi", max_tokens=2, top_k=5)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert (await complete(http, prompt="Hi", max_tokens=1)).status_code == 200


async def test_models_health_and_metrics(http: httpx.AsyncClient) -> None:
    models = (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = (await http.get("/health")).json()
    assert health["status"] == "ok" and health["workers"][0]["alive"]
    assert health["workers"][0]["node"] == "here"
    assert health["nodes"] == {"here": {"workers": 1, "alive": 1}}
    await complete(http, prompt="Hi", max_tokens=3, temperature=0, ignore_eos=True)
    text = (await http.get("/metrics")).text
    assert "pdserve_time_to_first_token_seconds_count 1.0" in text
    assert "pdserve_e2e_request_latency_seconds_count 1.0" in text
    assert "pdserve_generation_tokens_total 3.0" in text
    assert "pdserve_prompt_tokens_total 1.0" in text
    assert 'pdserve_num_requests_running{index="0",node="here",role="reference"} 0.0' in text


def test_binding_beyond_loopback_without_a_key_warns(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from frontend.http.app import build_app

    client = make_client()
    with caplog.at_level(logging.WARNING, logger="frontend.http.app"):
        build_app(client, client.tokenizer, make_settings(host="127.0.0.1"))
        build_app(client, client.tokenizer, make_settings(host="0.0.0.0", api_key="k"))
        assert "without an API key" not in caplog.text
        build_app(client, client.tokenizer, make_settings(host="0.0.0.0"))
    assert "without an API key" in caplog.text
