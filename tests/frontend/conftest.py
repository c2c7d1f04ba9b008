"""Fixtures for HTTP tests: the app over the transformers reference client, in-process
(httpx ASGI transport) or behind a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from frontend.http.app import build_app
from frontend.settings import FrontendSettings
from tests.frontend.reference_client import ReferenceEngineClient

torch.set_num_threads(1)
MODEL = "tiny-qwen2"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def reference_model(default_model_path: Path) -> tuple[Any, Any]:
    return ReferenceEngineClient.load(default_model_path)


def make_settings(**overrides: Any) -> FrontendSettings:
    base: dict[str, Any] = dict(model_name=MODEL, max_model_len=256, vocab_size=151936)
    return FrontendSettings(**{**base, **overrides})


@pytest.fixture
def make_client(reference_model: tuple[Any, Any]) -> Callable[..., ReferenceEngineClient]:
    def make(**kw: Any) -> ReferenceEngineClient:
        return ReferenceEngineClient(*reference_model, **kw)

    return make


@pytest.fixture
async def http(
    make_client: Callable[..., ReferenceEngineClient],
) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the app with default settings and a fresh reference client."""
    client = make_client()
    app = build_app(client, client.tokenizer, make_settings())
    app.state.engine = client
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield c


class LiveServer:
    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def live_server(make_client: Callable[..., ReferenceEngineClient]) -> Callable[..., LiveServer]:
    """``live_server(client=None, **settings)``: a started uvicorn server (context manager)."""

    def start(client: ReferenceEngineClient | None = None, **overrides: Any) -> LiveServer:
        engine = client or make_client()
        app = build_app(engine, engine.tokenizer, make_settings(**overrides))
        return LiveServer(app)

    return start


async def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()
