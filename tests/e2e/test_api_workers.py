"""``launch --api-workers 2``: two frontend processes behind one port, one server.

Each response names the frontend that served it (``x-pdserve-frontend``), so every test
checks it exercised both. One server takes the streaming, disconnect and shard-death
tests, then a frontend's death; a second, small one the shared admission bound.
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

from tests.conftest import LaunchedServer
from tests.e2e.helpers import (
    Exact,
    kv_in_use,
    pid_of,
    random_prompts,
    read_events_then_leave,
    run_with_kill,
    wait_all_alive,
    wait_kv_free,
)

pytestmark = pytest.mark.slow

HEADER = "x-pdserve-frontend"


@pytest.fixture(scope="module")
def pair() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        "--api-workers 2 --prefill 2 --decode 2 --detokenizers 2 --device cpu --kv-cache-tokens 8192 --max-model-len 1024"
    )


def test_both_frontends_serve_and_report_the_same_server(pair: LaunchedServer) -> None:
    # "Serving" means every role has a live worker; wait for the last ones to be ready too
    # (prefill workers that build dense copies of packed layers come up a little later).
    deadline = time.monotonic() + 60
    while pair.health()["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    frontends = [w for w in pair.health()["workers"] if w["role"] == "frontend"]
    assert [(w["index"], w["alive"]) for w in frontends] == [(0, True), (1, True)]
    assert {pid_of(pair, "pdserve:frontend-0"), pid_of(pair, "pdserve:frontend-1")} == {
        w["pid"] for w in frontends
    }
    seen, healths = set(), []
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for _ in range(40):
        with httpx.Client(base_url=pair.url, timeout=60) as client:  # a new connection each
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200
            seen.add(r.headers[HEADER])
            healths.append(client.get("/health").json()["status"])
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"} and set(healths) == {"ok"}
    metrics = httpx.get(pair.url + "/metrics", timeout=10).text
    assert 'pdserve_frontend_requests_total{frontend="1"}' in metrics


def test_streams_on_both_frontends_complete_exactly(pair: LaunchedServer, exact: Exact) -> None:
    results = exact.survives_kill(pair, 12, 3)  # nothing killed
    assert {r["frontend"] for r in results} == {"0", "1"}


def test_a_client_leaving_either_frontend_frees_kv_within_a_second(pair: LaunchedServer) -> None:
    body = {
        "input_ids": [5] * 40,
        "stream": True,
        "sampling_params": {"max_tokens": 800, "temperature": 0, "ignore_eos": True},
    }
    left: set[str] = set()
    for _ in range(30):
        with (
            httpx.Client(base_url=pair.url, timeout=60) as client,
            client.stream("POST", "/generate", json=body) as r,
        ):
            frontend = r.headers[HEADER]
            read_events_then_leave(pair, r)
        wait_kv_free(pair, 1.0, f"a client left frontend {frontend}: ")
        left.add(frontend)
        if left == {"0", "1"}:
            return
    raise AssertionError(f"every stream went to frontend {left}")


def test_a_shard_death_under_both_frontends_streams_loses_nothing(
    pair: LaunchedServer, exact: Exact
) -> None:
    results = exact.survives_kill(pair, 10, 11, "pdserve:detok-0")
    assert {r["frontend"] for r in results} == {"0", "1"}


def test_a_frontend_death_fails_only_its_own_streams_and_it_comes_back(
    pair: LaunchedServer, exact: Exact
) -> None:
    wait_all_alive(pair)
    prompts = random_prompts(12, seed=23)
    victim = pid_of(pair, "pdserve:frontend-1")
    results = run_with_kill(pair, prompts, "pdserve:frontend-1")
    mine = [(p, r) for p, r in zip(prompts, results, strict=True) if r["frontend"] == "0"]
    theirs = [r for r in results if r["frontend"] != "0"]
    assert mine and theirs, {r["frontend"] for r in results}
    for r in theirs:  # cut off: the connection broke before the end
        assert r["finish"] is None, r
    exact.check([r for _, r in mine], [p for p, _ in mine], pair.log)
    # The dead frontend's requests were abandoned: no worker keeps their KV.
    deadline = time.monotonic() + 10
    while kv_in_use(pair) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_in_use(pair) == 0
    wait_all_alive(pair)
    assert pid_of(pair, "pdserve:frontend-1") != victim
    seen = set()
    body = {"prompt": "again", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    for _ in range(40):
        with httpx.Client(base_url=pair.url, timeout=60) as client:
            r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        seen.add(r.headers[HEADER])
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"}


# Admission, where only the routers' books can hold it: decode-0 is stopped (SIGSTOP) with
# nothing running, so it reports nothing new while the requests arrive, and it admits while
# fewer than WAITING requests wait for it. Two frontends that each kept their own books
# would admit WAITING each; shared, the bound is the server's (one more at most, when both
# decide in the same instant).
WAITING = 2


@pytest.fixture(scope="module")
def bounded() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        [
            *shlex.split(
                "--api-workers 2 --prefill 1 --decode 1 --detokenizers 1 --device cpu --kv-cache-tokens 8192 --max-model-len 1024 --max-num-seqs 2 --max-waiting-requests"
            ),
            str(WAITING),
            "--stall-timeout",
            "60",
        ]
    )


def test_the_admission_bound_holds_across_both_frontends(bounded: LaunchedServer) -> None:
    clients = 32
    body = {
        "input_ids": [7] * 8,
        "stream": True,
        "sampling_params": {"max_tokens": 20, "temperature": 0, "ignore_eos": True},
    }
    decode = pid_of(bounded, "pdserve:decode-0")

    async def main() -> tuple[list[tuple[int, str]], list[str | None]]:
        answered = asyncio.Event()
        statuses: list[tuple[int, str]] = []
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=bounded.url, timeout=60, limits=limits) as client:

            async def one() -> str | None:
                async with client.stream("POST", "/generate", json=body) as r:
                    statuses.append((r.status_code, r.headers[HEADER]))
                    if len(statuses) == clients:
                        answered.set()
                    finish = None
                    if r.status_code == 200:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                finish = json.loads(line[6:]).get("finish_reason") or finish
                    return finish

            tasks = [asyncio.create_task(one()) for _ in range(clients)]
            await asyncio.wait_for(answered.wait(), 60)
            os.kill(decode, signal.SIGCONT)  # the admitted ones may now run
            finishes = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return statuses, finishes

    os.kill(decode, signal.SIGSTOP)
    try:
        statuses, finishes = asyncio.run(main())
    finally:
        os.kill(decode, signal.SIGCONT)
    admitted = [f for code, f in statuses if code == 200]
    refused = [f for code, f in statuses if code == 503]
    assert len(admitted) + len(refused) == clients, statuses
    assert 1 <= len(admitted) <= WAITING + 1, statuses
    assert set(refused) == {"0", "1"}, statuses  # refused by both: the bound is the server's
    assert sorted(f for f in finishes if f) == ["length"] * len(admitted)
    deadline = time.monotonic() + 10
    while kv_in_use(bounded) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_in_use(bounded) == 0
