"""/tokenize, /detokenize and /version as vLLM shapes them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.frontend.conftest import MODEL

pytestmark = pytest.mark.anyio


async def test_tokenize_a_prompt_and_back(http: httpx.AsyncClient, qwen_tokenizer: Any) -> None:
    r = await http.post(
        "/tokenize", json={"model": MODEL, "prompt": "Hello world, café", "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    ids = qwen_tokenizer.encode("Hello world, café")
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == 256
    assert body["token_strs"] == qwen_tokenizer.convert_ids_to_tokens(ids)
    back = await http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world, café"}


async def test_tokenize_messages_through_the_chat_template(
    http: httpx.AsyncClient, qwen_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = await http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    text = qwen_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == qwen_tokenizer.encode(text, add_special_tokens=False)
    assert r.json()["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ],
)
async def test_bad_bodies_are_4xx_naming_the_field(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert param in r.text


async def test_version(http: httpx.AsyncClient) -> None:
    r = await http.get("/version")
    assert r.status_code == 200 and r.json()["version"] == "0.1.0"


async def test_the_stats_line_reports_traffic_and_is_silent_when_idle(
    make_client: Any,
) -> None:
    from frontend.http.app import build_app
    from frontend.telemetry.stats_log import StatsLog
    from tests.frontend.conftest import make_settings

    client = make_client()
    app = build_app(client, client.tokenizer, make_settings())
    stats = StatsLog(client, app.state.ctx.metrics)
    assert stats.line() is None  # nothing happened yet
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as h:
        r = await h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        )
        assert r.status_code == 200
    line = stats.line()
    assert line is not None and "prompt " in line and "generation " in line
    assert "running 0 reqs" in line and "KV " in line
    assert stats.line() is None  # idle again
