"""Batch-invariant serving (``--enable-deterministic-inference``), launched.

The same 16 greedy prompts and 8 seeded sampled ones (temperature 0.8, logprobs 5) give
the same tokens and the same logprobs, compared as floats, on a co-located server: sent
one at a time, among 24 concurrent requests of random lengths, after their prefixes were
cached, and with n-gram speculation on. The tiny model runs the torch reference path;
SmolLM2 (the packed default, its fused kernels) is checked across topologies, a decode
worker's death and the KV tiers in ``test_determinism_topologies.py``.
"""

from __future__ import annotations

import asyncio
import random
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # servers on a shared machine
DET = "--enable-deterministic-inference"
COMMON = "--device cpu --kv-cache-tokens 16384 --max-model-len 1024"
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
MAX_TOKENS = 12


def checked_bodies(n: int, seed: int, vocab: int) -> list[dict[str, Any]]:
    """16 greedy bodies, then 8 seeded sampled ones, prompts of random ids and lengths."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(4, 90))]
        sampling = {"temperature": 0.0} if i < 16 else {"temperature": 0.8, "seed": 1000 + i}
        bodies.append({"prompt": prompt, "logprobs": 5, "max_tokens": MAX_TOKENS, **sampling})
    return bodies


def background_bodies(n: int, seed: int, vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "prompt": [rng.randrange(100, vocab) for _ in range(rng.randrange(2, 300))],
            "max_tokens": rng.randrange(1, 40),
            "temperature": 1.0,
        }
        for _ in range(n)
    ]


async def _send(client: httpx.AsyncClient, name: str, body: dict[str, Any]) -> Any:
    r = await client.post("/v1/completions", json={"model": name, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return (r.json()["choices"][0]["text"], lp and lp["tokens"], lp and lp["token_logprobs"],
            lp and lp["top_logprobs"])  # fmt: skip


def one_at_a_time(server: LaunchedServer, name: str, bodies: list[dict[str, Any]]) -> list[Any]:
    async def main() -> list[Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return [await _send(client, name, b) for b in bodies]

    return asyncio.run(main())


def all_at_once(
    server: LaunchedServer, name: str, bodies: list[dict[str, Any]], others: list[dict[str, Any]]
) -> list[Any]:
    """``bodies`` interleaved with ``others``, all in flight together: ``bodies``' answers."""
    mixed = [b for pair in zip(bodies, others) for b in pair] + others[len(bodies) :]

    async def main() -> list[Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await asyncio.gather(*(_send(client, name, b) for b in mixed))

    got = asyncio.run(main())
    return [got[mixed.index(b)] for b in bodies]


TINY = "tiny"
TINY_VOCAB = 150_000
CHECKED = checked_bodies(24, 0, TINY_VOCAB)
OTHERS = background_bodies(24, 1, TINY_VOCAB)


def _tiny(flags: str) -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(f"{flags} {COMMON} --served-model-name {TINY} {DET}")


# One server at a time beside the reference one: stopped when its test ends.
serving = contextmanager(LaunchedServer.serving)
serving_tiny = contextmanager(_tiny)


@pytest.fixture(scope="module")
def colocated() -> Iterator[LaunchedServer]:
    yield from _tiny("--colocated 1")


@pytest.fixture(scope="module")
def reference(colocated: LaunchedServer) -> list[Any]:
    """Co-located, one request at a time, each prompt cold (its first time)."""
    return one_at_a_time(colocated, TINY, CHECKED)


def test_server_says_it_is_deterministic(colocated: LaunchedServer) -> None:
    assert colocated.health()["deterministic"] is True
    models = httpx.get(colocated.url + "/v1/models", timeout=30).json()["data"]
    assert models[0]["deterministic"] is True


def test_concurrent_and_cached_equal_one_at_a_time(
    colocated: LaunchedServer, reference: list[Any]
) -> None:
    assert reference[0][2] and all(isinstance(x, float) for x in reference[0][2])
    assert all_at_once(colocated, TINY, CHECKED, OTHERS) == reference
    # Every prompt now has its full blocks in the prefix cache.
    assert one_at_a_time(colocated, TINY, CHECKED) == reference


def test_ngram_speculation_equals_plain_decoding(reference: list[Any]) -> None:
    with serving_tiny(f"--colocated 1 --speculative-config {shlex.quote(NGRAM_CONFIG)}") as server:
        assert all_at_once(server, TINY, CHECKED, OTHERS) == reference
        assert one_at_a_time(server, TINY, CHECKED[:6]) == reference[:6]
