"""A handler's own bug: a 500 in the API's shape whose request id is in the log beside
the traceback, and the app serves on (issue 36)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from frontend.http import app as app_module
from frontend.http.app import build_app
from tests.frontend.conftest import MODEL, make_settings

pytestmark = pytest.mark.anyio


async def broken(*args: Any) -> Any:
    raise KeyError("a bug in a handler, quoting its input: " + "x" * 1_000_000)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "hi"}),
        (
            "/v1/messages/count_tokens",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
async def test_a_handler_bug_is_a_logged_500_with_a_request_id(
    make_client: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, Any],
) -> None:
    model, _ = app_module.ROUTES[path]
    monkeypatch.setitem(app_module.ROUTES, path, (model, broken))
    client = make_client()
    app = build_app(client, client.tokenizer, make_settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        with caplog.at_level(logging.ERROR, logger="frontend.http.app"):
            r = await http.post(path, json=body)
        assert r.status_code == 500
        incident = r.headers["x-request-id"]
        payload = r.json()
        message = payload["error"]["message"]
        if path.startswith("/v1/messages"):
            assert payload["type"] == "error" and payload["error"]["type"] == "api_error"
        else:
            assert payload["error"]["type"] == "server_error"
        assert incident in message
        logged = [rec for rec in caplog.records if incident in rec.getMessage()]
        assert len(logged) == 1  # the traceback, under that id, bounded though the
        text = logged[0].getMessage()  # exception's message quotes a megabyte
        assert "Traceback" in text and "in broken" in text and "a bug in a handler" in text
        assert len(text) < 5000 and all(len(line) <= 200 for line in text.splitlines())
        # The app serves on: another endpoint answers, and the broken one again.
        assert (await http.post("/detokenize", json={"tokens": [1, 2]})).status_code == 200
        assert (await http.post(path, json=body)).status_code == 500
