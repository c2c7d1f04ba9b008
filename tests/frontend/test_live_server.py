"""The app behind a real uvicorn server: the official OpenAI SDK, and client disconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.frontend.conftest import MODEL, LiveServer, wait_for

pytestmark = pytest.mark.anyio


async def test_openai_sdk_completions_and_chat(live_server: Callable[..., LiveServer]) -> None:
    with live_server() as srv:
        url = srv.base_url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as sdk:
            await _exercise_sdk(sdk)


async def _exercise_sdk(sdk: openai.AsyncOpenAI) -> None:
    c = await sdk.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.choices[0].finish_reason == "length" and c.usage and c.usage.completion_tokens == 4
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="'suffix' is not supported"):
        await sdk.completions.create(model=MODEL, prompt="x", suffix="y")
    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="gpt-4", prompt="x")
    models = await sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_openai_sdk_sends_the_api_key(live_server: Callable[..., LiveServer]) -> None:
    with live_server(api_key="k3y") as srv:
        url = srv.base_url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="k3y", max_retries=0) as good:
            await good.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        async with openai.AsyncOpenAI(base_url=url, api_key="nope", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model=MODEL, prompt="Hi", max_tokens=1)


def loud_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines a disconnect must not cause: warnings and above, or any traceback."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request(
    live_server: Callable[..., LiveServer],
    make_client: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    engine = make_client(step_delay_s=0.05)
    caplog.set_level(logging.INFO)
    with live_server(client=engine) as srv:
        body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": stream}
        async with httpx.AsyncClient(base_url=srv.base_url) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            assert await wait_for(lambda: bool(engine.running), timeout_s=10)
            (rid,) = engine.running
            await asyncio.sleep(0.2)  # a few tokens in
            task.cancel()  # closes the connection mid-request
            await asyncio.gather(task, return_exceptions=True)
        # The contract: aborted within one second of the disconnect.
        assert await wait_for(lambda: rid in engine.aborted, timeout_s=1.0)
        assert await wait_for(lambda: not engine.running, timeout_s=5)
    # A client that leaves is ordinary: info at most, and no traceback.
    assert loud_records(caplog) == []


async def test_client_gone_mid_upload_is_quiet(
    live_server: Callable[..., LiveServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with live_server() as srv:
        host, port = srv.base_url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            b'{"prompt": "'
        )
        await writer.drain()
        await asyncio.sleep(0.2)  # the handler is reading the body
        writer.close()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=srv.base_url) as http:  # still serving
            assert (await http.get("/v1/models")).status_code == 200
    assert loud_records(caplog) == []


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_every_choice(
    live_server: Callable[..., LiveServer], make_client: Callable[..., Any], stream: bool
) -> None:
    engine = make_client(step_delay_s=0.05)
    with live_server(client=engine) as srv:
        body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": stream, "n": 3}
        async with httpx.AsyncClient(base_url=srv.base_url) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            assert await wait_for(lambda: len(engine.running) == 3, timeout_s=10)
            rids = set(engine.running)
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert await wait_for(lambda: rids <= set(engine.aborted), timeout_s=1.0)
        assert await wait_for(lambda: not engine.running, timeout_s=5)
