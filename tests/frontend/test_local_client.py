"""The app over ``LocalEngineClient``: the project's engine and detokenizer in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from colocated.llm import LLM
from engine.config import EngineConfig
from frontend.app import build_app
from frontend.local_client import LocalEngineClient
from tests.frontend.conftest import MODEL, make_settings, wait_for
from tests.frontend.test_app import sse_events
from wire.params import SamplingParams

pytestmark = pytest.mark.anyio


def engine_config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=64, max_model_len=256)


@pytest.fixture
async def local(default_model_path: Path, qwen_tokenizer: Any) -> AsyncIterator[Any]:
    client = LocalEngineClient(engine_config(default_model_path), qwen_tokenizer)
    app = build_app(client, qwen_tokenizer, make_settings())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as h:
        yield h, client
    await client.close()


async def test_greedy_output_matches_the_engine_run_directly(
    local: Any, default_model_path: Path, qwen_tokenizer: Any
) -> None:
    http, _ = local
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    prompt = qwen_tokenizer.encode("Hello world")
    direct = LLM(engine_config(default_model_path)).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert choice["token_ids"] == direct.output_ids
    assert choice["text"] == qwen_tokenizer.decode(direct.output_ids)
    stream = await http.post("/v1/completions", json={**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in sse_events(stream.text)) == choice["text"]


async def test_concurrent_seeded_requests_are_reproducible(local: Any) -> None:
    http, client = local
    body = {"prompt": "Tell me", "max_tokens": 10, "temperature": 0.9, "seed": 11,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    replies = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))
    outs = [r.json()["choices"][0]["token_ids"] for r in replies]
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 10
    alloc = client.runner.allocator
    assert await wait_for(lambda: alloc.num_available == alloc.num_blocks, timeout_s=5)


async def test_stop_string_and_logprobs_through_the_shard(local: Any) -> None:
    http, client = local
    common = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = (await http.post("/v1/completions", json=common)).json()["choices"][0]["text"]
    stop = full[4:7]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    r = await http.post("/v1/completions", json={**common, "stop": [stop], "logprobs": 2})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    alloc = client.runner.allocator
    assert await wait_for(lambda: alloc.num_available == alloc.num_blocks, timeout_s=5)


async def test_prompt_too_big_for_the_kv_pool_is_a_500(
    default_model_path: Path, qwen_tokenizer: Any
) -> None:
    config = EngineConfig(model=str(default_model_path), num_kv_blocks=2, max_model_len=256)
    client = LocalEngineClient(config, qwen_tokenizer)
    app = build_app(client, qwen_tokenizer, make_settings())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as h:
        r = await h.post("/v1/completions", json={"prompt": [1] * 100, "max_tokens": 50})
        assert r.status_code == 500 and "blocks" in r.json()["error"]["message"]
        assert (
            await h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        ).status_code == 200
    await client.close()


async def test_abort_ends_the_stream_and_frees_kv(
    default_model_path: Path, qwen_tokenizer: Any
) -> None:
    from frontend.engine_client import EngineRequest
    from wire.params import DetokParams
    from wire.records import Finish

    client = LocalEngineClient(engine_config(default_model_path), qwen_tokenizer)
    sampling = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    req = EngineRequest(rid=77, prompt_ids=[9707], sampling=sampling, detok=DetokParams())
    deltas = []
    async for delta in client.generate(req):
        if not deltas:
            await client.abort(77)
        deltas.append(delta)
    assert deltas[-1].finish == Finish.ABORT
    assert sum(len(d.token_ids) for d in deltas) < 200
    alloc = client.runner.allocator
    assert await wait_for(lambda: alloc.num_available == alloc.num_blocks, timeout_s=5)
    assert client.health()[0].alive
    await client.close()
    assert not client.health()[0].alive
