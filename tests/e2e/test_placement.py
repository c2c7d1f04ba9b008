"""Placement on a launched 2 prefill + 4 decode server (issue: the pipeline's done-means).

64 requests of mixed prompt and output lengths arrive in bursts, as from many clients;
afterwards the router's own counters (``/metrics``) must put every worker within 25 % of
its role's mean token load, and those counters must account for exactly the tokens sent.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.router.sim import mixed_request

N_PREFILL, N_DECODE, N_REQUESTS = 2, 4, 64
_SAMPLE = re.compile(
    r'^pdserve_router_assigned_tokens_total\{index="(\d+)",node="[^"]+",role="(\w+)"\} (\S+)$'
)


@pytest.fixture(scope="module")
def wide() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        f"--prefill {N_PREFILL} --decode {N_DECODE} "
        "--detokenizers 1 --device cpu --kv-cache-tokens 16384 --max-model-len 2048"
    )


async def _bursts(url: str, requests: list[tuple[list[int], int]], rng: random.Random) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(ids: list[int], max_tokens: int) -> None:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            }
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            assert len(r.json()["output_ids"]) == max_tokens

        tasks, sent = [], 0
        while sent < len(requests):
            burst = min(rng.randint(1, 12), len(requests) - sent)
            tasks += [asyncio.create_task(one(*req)) for req in requests[sent : sent + burst]]
            sent += burst
            await asyncio.sleep(rng.uniform(0.005, 0.05))
        await asyncio.gather(*tasks)


def _assigned_tokens(url: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"prefill": {}, "decode": {}}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if m := _SAMPLE.match(line):
            out[m[2]][int(m[1])] = float(m[3])
    return out


def _spread(loads: dict[int, float], n: int) -> float:
    values = [loads.get(i, 0.0) for i in range(n)]
    mean = sum(values) / n
    return max(abs(v - mean) / mean for v in values)


def test_64_mixed_requests_spread_within_25_percent_of_the_mean(wide: LaunchedServer) -> None:
    rng = random.Random(11)
    requests = []
    for _ in range(N_REQUESTS):
        prompt_len, max_tokens = mixed_request(rng, long=(1024, 1536), output=(8, 96))
        requests.append(([rng.randrange(1000, 150_000) for _ in range(prompt_len)], max_tokens))
    before = _assigned_tokens(wide.url)
    asyncio.run(_bursts(wide.url, requests, rng))
    after = _assigned_tokens(wide.url)
    load = {
        role: {i: after[role][i] - before[role].get(i, 0.0) for i in after[role]} for role in after
    }

    assert sum(load["prefill"].values()) == sum(len(ids) for ids, _ in requests)
    assert sum(load["decode"].values()) == sum(len(ids) + n for ids, n in requests)
    assert _spread(load["prefill"], N_PREFILL) <= 0.25, load["prefill"]
    assert _spread(load["decode"], N_DECODE) <= 0.25, load["decode"]
