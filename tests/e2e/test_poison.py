"""Poison requests and workers in back-off, on a real launched server.

A request that crashes every decode worker it reaches (the test-only fault of
``runtime/faults.py``) is ended with an error after its one retry, while 8 streams beside
it finish exactly; the server serves on with no worker in back-off. A detokenizer shard
in crash-loop back-off is routed around (no 503 while the other shard lives), shown in
``/health`` with when it is retried, and started again then.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from runtime.faults import CRASH_TOKEN_ENV
from tests.conftest import LaunchedServer
from tests.e2e.helpers import Exact, greedy_stream, pid_of, random_prompts, wait_all_alive

POISON_TOKEN = 151_000  # above random_prompts' ids: only the poison prompt holds it
ARGS = (
    "--prefill 1 --decode 1 --detokenizers 2 --device cpu --kv-cache-tokens 8192 "
    "--max-model-len 1024 --served-model-name tiny"
)


@pytest.fixture(scope="module")
def poisonable() -> Iterator[LaunchedServer]:
    """1 prefill, 1 decode, 2 shards; a prompt holding POISON_TOKEN aborts a decode worker."""
    os.environ[CRASH_TOKEN_ENV] = f"decode:{POISON_TOKEN}"
    try:
        srv = LaunchedServer(shlex.split(ARGS))
    finally:
        del os.environ[CRASH_TOKEN_ENV]  # the launch has it; nothing else started here does
    srv.wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


async def _poison_stream(client: httpx.AsyncClient, prompt: list[int]) -> dict:  # type: ignore[type-arg]
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_tokens": 16, "temperature": 0},
    }
    last: dict = {}  # type: ignore[type-arg]
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return last


def test_a_request_that_kills_its_worker_ends_after_its_retry_and_the_rest_finish_exactly(
    poisonable: LaunchedServer, exact: Exact
) -> None:
    wait_all_alive(poisonable)
    prompts = random_prompts(8, seed=59)
    poison_prompt = [*random_prompts(1, seed=60)[0], POISON_TOKEN]
    decode_pid = pid_of(poisonable, "pdserve:decode-0")

    async def main() -> tuple[list[dict], dict]:  # type: ignore[type-arg]
        async with httpx.AsyncClient(base_url=poisonable.url, timeout=300) as client:
            started = asyncio.Event()
            tasks = [asyncio.create_task(greedy_stream(client, p, started)) for p in prompts]
            poison = asyncio.create_task(_poison_stream(client, poison_prompt))
            return await asyncio.gather(*tasks), await poison

    results, poisoned = asyncio.run(main())
    assert poisoned["finish_reason"] == "error", poisoned
    assert "request ended: the decode worker died twice while serving it" in poisoned["error"]
    exact.check(results, prompts, poisonable.log)
    assert pid_of(poisonable, "pdserve:decode-0") != decode_pid  # it did die, and came back
    wait_all_alive(poisonable)
    health = poisonable.health()
    assert health["status"] == "ok", health
    assert all(w["state"] == "ready" and w["retry_at"] is None for w in health["workers"])
    metrics = httpx.get(poisonable.url + "/metrics", timeout=10).text
    assert "pdserve_requests_poisoned_total 1.0" in metrics
    named = [line for line in poisonable.log if "ended as a poison request" in line]
    assert len(named) == 1 and str(POISON_TOKEN) not in named[0], named
    assert not any("crash-loop" in line for line in poisonable.log)


def _health(server: LaunchedServer) -> dict:  # type: ignore[type-arg]
    return httpx.get(server.url + "/health", timeout=10).json()  # type: ignore[no-any-return]


def _shard(server: LaunchedServer, k: int) -> dict:  # type: ignore[type-arg]
    health = _health(server)
    return next(w for w in health["workers"] if w["role"] == "detokenizer" and w["index"] == k)


def _kill_until_backoff(server: LaunchedServer, name: str, k: int) -> dict:  # type: ignore[type-arg]
    """SIGKILL shard ``k`` each time it is back, until the launcher puts it in back-off."""
    for _ in range(12):
        shard = _shard(server, k)
        if shard["state"] == "failed":
            return shard
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until it is back, or in back-off
            shard = _shard(server, k)
            if shard["alive"] or shard["state"] == "failed":
                break
            time.sleep(0.1)
        if shard["state"] == "failed":
            return shard
        os.kill(pid_of(server, name), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _shard(server, k)["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
    raise AssertionError(f"shard {k} never went into back-off: {_shard(server, k)}")


def test_a_shard_in_backoff_is_routed_around_and_retried(poisonable: LaunchedServer) -> None:
    wait_all_alive(poisonable)
    shard = _kill_until_backoff(poisonable, "pdserve:detok-1", 1)
    assert shard["retry_at"] is not None and shard["retry_at"] > time.time(), shard
    assert _health(poisonable)["status"] == "degraded"
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    with httpx.Client(base_url=poisonable.url, timeout=120) as client:
        statuses = [client.post("/generate", json=body).status_code for _ in range(24)]
    assert statuses == [200] * 24  # every rid whose shard would be 1 went to shard 0
    assert _shard(poisonable, 1)["state"] == "failed"  # (still in back-off all along)
    wait_all_alive(poisonable, timeout_s=120)  # retried after its back-off
    assert _shard(poisonable, 1)["retry_at"] is None
