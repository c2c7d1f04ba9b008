"""The chat template renders off the event loop: a huge conversation stalls no one else.

Found against the launched server: 100,000 messages took seconds inside
``apply_chat_template``, during which every other stream on the frontend stood still.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from frontend.http.app import build_app
from tests.frontend.conftest import MODEL, make_settings

pytestmark = pytest.mark.anyio


class GatedTokenizer:
    """The real tokenizer, except that rendering a template waits for ``gate``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered, self.gate = threading.Event(), threading.Event()
        self.gate_timed_out = False

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        # On the event loop this wait would freeze the loop; bounded so the test fails
        # instead of hanging.
        if not self.gate.wait(timeout=10):
            self.gate_timed_out = True
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_other_requests_are_served_while_a_template_renders(
    make_client: Callable[..., Any],
) -> None:
    engine = make_client()
    tokenizer = GatedTokenizer(engine.tokenizer)
    app = build_app(engine, tokenizer, make_settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "temperature": 0,
        }
        chat = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        while not tokenizer.entered.is_set():
            await asyncio.sleep(0.01)
        models = await http.get("/v1/models")  # answered while the template is held
        assert models.status_code == 200
        assert not tokenizer.gate_timed_out, "the template held the event loop"
        tokenizer.gate.set()
        r = await chat
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
