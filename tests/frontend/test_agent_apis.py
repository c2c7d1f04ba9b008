"""The agent APIs at the HTTP edge, in process over the transformers reference client:
Anthropic's error shape on its paths (the guard's and routing's errors too), ``x-api-key``,
pings on a quiet Messages stream, and the keep-alive wrapper that makes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from frontend.api.anthropic import messages as messages_api
from frontend.api.common.sse import with_keepalive
from frontend.http.app import build_app
from tests.frontend.conftest import MODEL, make_settings

pytestmark = pytest.mark.anyio
ASK = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}


def client_for(make_client: Callable[..., Any], **settings: Any) -> httpx.AsyncClient:
    engine = make_client()
    app = build_app(engine, engine.tokenizer, make_settings(**settings))
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000"
    )


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return str(body["error"]["message"])


async def test_x_api_key_opens_the_api_as_bearer_does(make_client: Callable[..., Any]) -> None:
    async with client_for(make_client, api_key="s3cret") as h:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            message = anthropic_error(await h.post(path, json=ASK), 401, "authentication_error")
            assert "x-api-key" in message
            wrong = await h.post(path, json=ASK, headers={"x-api-key": "guess"})
            anthropic_error(wrong, 401, "authentication_error")
        ok = await h.post("/v1/messages", json=ASK, headers={"x-api-key": "s3cret"})
        assert ok.status_code == 200 and ok.json()["type"] == "message"
        bearer = await h.post("/v1/messages", json=ASK, headers={"authorization": "Bearer s3cret"})
        assert bearer.status_code == 200
        # Other paths take x-api-key too, and keep OpenAI's error shape.
        chat = {"model": MODEL, "max_tokens": 2, "messages": ASK["messages"]}
        assert (
            await h.post("/v1/chat/completions", json=chat, headers={"x-api-key": "s3cret"})
        ).status_code == 200
        refused = await h.post("/v1/responses", json={"input": "Hi"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


async def test_edge_errors_on_anthropic_paths_are_anthropic_shaped(
    make_client: Callable[..., Any],
) -> None:
    async with client_for(make_client) as h:
        form = await h.post(
            "/v1/messages",
            content=b"a=b",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert "Content-Type" in anthropic_error(form, 415, "invalid_request_error")
        anthropic_error(await h.get("/v1/messages"), 405, "invalid_request_error")
        anthropic_error(await h.post("/v1/messages/nothing", json={}), 404, "not_found_error")
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            big = await h.post(
                path, content=b" " * (9 << 20), headers={"content-type": "application/json"}
            )
            anthropic_error(big, 413, "request_too_large")


async def test_a_quiet_stream_gets_pings(
    make_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages_api, "PING_S", 0.05)
    engine = make_client(step_delay_s=0.3)  # each token takes longer than a ping interval
    app = build_app(engine, engine.tokenizer, make_settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as h:
        r = await h.post("/v1/messages", json={**ASK, "stream": True})
    names = [
        line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")
    ]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert "ping" in names
    assert 'data: {"type":"ping"}' in r.text


async def test_keepalive_yields_none_while_quiet_and_closes_its_source() -> None:
    closed = asyncio.Event()

    async def slow() -> AsyncIterator[int]:
        try:
            for i in range(3):
                await asyncio.sleep(0.12)
                yield i
        finally:
            closed.set()

    got = [x async for x in with_keepalive(slow(), 0.05)]
    assert [x for x in got if x is not None] == [0, 1, 2] and None in got
    assert closed.is_set()
    closed.clear()
    left = with_keepalive(slow(), 0.05)
    assert await anext(left) is None  # waiting on the first item
    await left.aclose()  # the consumer leaves: the source is closed, not left running
    assert closed.is_set()


async def test_an_engine_error_is_a_500_the_sdks_do_not_retry(
    make_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the engine ended with an error (here: its constraint allowed no next
    token) would fail the same way again, and a poison one would take workers down with
    each try: its 500 says ``x-should-retry: false``, which both SDKs obey (they retry a
    500 twice by default)."""
    import dataclasses

    from frontend.api.openai import responses as responses_api
    from wire.records import Finish

    why = "the output constraint allowed no next token, so the request was ended"
    for module in (messages_api, responses_api):
        real = module.read_answer

        def failed(*args: Any, real: Any = real) -> Any:
            return dataclasses.replace(real(*args), finish=Finish.ERROR, error=why)

        monkeypatch.setattr(module, "read_answer", failed)
    async with client_for(make_client) as h:
        r = await h.post("/v1/messages", json=ASK)
        message = anthropic_error(r, 500, "api_error")
        assert message == f"the engine failed this request: {why}"
        assert r.headers["x-should-retry"] == "false"
        r = await h.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
        assert r.status_code == 500 and r.headers["x-should-retry"] == "false", r.text
        assert r.json()["error"]["message"] == f"the engine failed this request: {why}"
        ok = await h.post("/v1/chat/completions", json={**ASK, "max_tokens": 2})
        assert ok.status_code == 200 and "x-should-retry" not in ok.headers
