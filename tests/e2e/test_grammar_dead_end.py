"""A step whose grammar mask allows no token ends that request, and only that request,
with an error that says so: the worker that sampled it lives on, and 8 greedy requests
in flight on the same workers come out token for token as they do alone.

The all-masked step is forced by the test-only ``PDSERVE_TEST_GRAMMAR_DEAD_END`` marker
(engine/sampling/grammar_mask.py): a request whose regex holds ``MARKER`` and then N has
a mask that allows nothing at its output position N. N = 0 is the first token (sampled
by the prefill worker, or the co-located one); N = 3 a later step (the decode worker).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.sampling.grammar_mask import DEAD_END_ENV
from tests.conftest import LaunchedServer
from tests.e2e.helpers import concurrent_greedy, reported_pids

MARKER = "deadend"
MAX_TOKENS = 24
PROMPTS = [[(7 * i + 3 * j) % 5000 + 100 for j in range(9 + 5 * i)] for i in range(8)]


@pytest.fixture(
    scope="module",
    params=["--prefill 1 --decode 1", "--colocated 1"],
    ids=["1P1D", "colocated"],
)
def dead_end_server(request: pytest.FixtureRequest) -> Iterator[LaunchedServer]:
    # The launch inherits this process's environment: every worker sees the marker.
    os.environ[DEAD_END_ENV] = MARKER
    try:
        args = f"{request.param} --detokenizers 1 --device cpu --kv-cache-tokens 8192 --max-model-len 512 --served-model-name tiny"
        server = LaunchedServer(args.split())
        server.wait_ready()
    finally:
        del os.environ[DEAD_END_ENV]
    try:
        yield server
    finally:
        server.stop()


def _dead_end_body(position: int, temperature: float, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "Say something.",
        "max_tokens": 16,
        "temperature": temperature,
        "stream": stream,
        "structured_outputs": {"regex": f"{MARKER}{position}[a-z]{{1,40}}"},
    }


def _began_the_regex(text: str, position: int) -> bool:
    head = f"{MARKER}{position}"
    return bool(text) and (head.startswith(text) or re.fullmatch(head + "[a-z]*", text) is not None)


async def _dead_end(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """The request's last choice: the whole body's, or the stream's final chunk's."""
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]  # type: ignore[no-any-return]
    last: dict[str, Any] = {}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    last = choice
    return {**last, "text": text}


async def _together(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    bodies = [_dead_end_body(p, t, s) for p in (0, 3) for t in (0.0, 1.0) for s in (False, True)]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        greedy = asyncio.ensure_future(concurrent_greedy(url, PROMPTS, MAX_TOKENS))
        ended = await asyncio.gather(*(_dead_end(client, b) for b in bodies))
        return await greedy, list(ended)


def test_an_all_masked_step_ends_its_request_and_no_other(dead_end_server: LaunchedServer) -> None:
    pids = reported_pids(dead_end_server)
    alone = [
        asyncio.run(concurrent_greedy(dead_end_server.url, [p], MAX_TOKENS))[0] for p in PROMPTS
    ]
    together, ended = asyncio.run(_together(dead_end_server.url))
    assert [r["output_ids"] for r in together] == [r["output_ids"] for r in alone]
    assert all(len(r["output_ids"]) == MAX_TOKENS for r in together)
    for choice in ended:
        assert choice["finish_reason"] == "error", choice
        assert "allowed no next token" in choice["error"], choice
    # Position 3's request got its first three tokens (the regex's start) before the end.
    assert all(c["text"] == "" for c in ended[:4])
    assert all(_began_the_regex(c["text"], 3) for c in ended[4:]), ended[4:]
    health = dead_end_server.health()
    assert health["status"] == "ok", health
    assert reported_pids(dead_end_server) == pids  # no worker died or was replaced
