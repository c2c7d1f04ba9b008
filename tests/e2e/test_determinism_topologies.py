"""Batch-invariant serving (``--enable-deterministic-inference``) across topologies.

The checked set of ``test_determinism.py`` (16 greedy prompts and 8 seeded sampled ones
at temperature 0.8, logprobs 5) on the tiny model (the torch reference path) gives, as
floats, the tokens and logprobs of a co-located server taking them one at a time:

* served ``--prefill 1 --decode 1`` and ``--prefill 2 --decode 2``, one at a time and
  among 24 concurrent requests of random lengths (the prefill worker's steps then run
  at 1 or 2 threads as the decode worker is busy or not: the core lease);
* streamed while a decode worker is SIGKILLed: the requests it held resume elsewhere,
  re-prefilled with the tokens they had, and go on with the same bits;
* co-located on a small pool, after the prompts' prefixes were evicted to tier 2 (host
  RAM), and after a restart that leaves them in tier 3 (disk) alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import pid_of, wait_all_alive
from tests.e2e.test_determinism import (
    CHECKED,
    DET,
    NGRAM_CONFIG,
    OTHERS,
    TINY,
    all_at_once,
    background_bodies,
    checked_bodies,
    one_at_a_time,
    serving,
    serving_tiny,
)
from tests.e2e.test_determinism import _tiny as tiny_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # servers on a shared machine


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    """Co-located, one request at a time, each prompt cold (its first time)."""
    with serving_tiny("--colocated 1") as server:  # stopped before the others start
        return one_at_a_time(server, TINY, CHECKED)


@pytest.fixture(scope="module")
def two_by_two() -> Iterator[LaunchedServer]:
    for server in tiny_server("--prefill 2 --decode 2"):
        wait_all_alive(server)  # serving is printed before every worker has loaded
        yield server


def test_one_prefill_one_decode_equals_colocated(reference: list[Any]) -> None:
    with serving_tiny("--prefill 1 --decode 1") as server:
        wait_all_alive(server)
        assert server.health()["deterministic"] is True
        assert one_at_a_time(server, TINY, CHECKED) == reference
        assert all_at_once(server, TINY, CHECKED, OTHERS) == reference


def test_two_prefill_two_decode_equals_colocated(
    two_by_two: LaunchedServer, reference: list[Any]
) -> None:
    assert all_at_once(two_by_two, TINY, CHECKED, OTHERS) == reference
    # The prompts' prefixes are now cached on some worker of each pool.
    assert one_at_a_time(two_by_two, TINY, CHECKED) == reference


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event, name: str = TINY
) -> tuple[Any, ...]:
    """One streamed completion, its chunks joined into ``_send``'s (text, tokens,
    token_logprobs, top_logprobs); ``started`` is set once 3 tokens have come."""
    text, tokens, logprobs, top = "", [], [], []
    stream = {"model": name, "ignore_eos": True, "stream": True, **body}
    async with client.stream("POST", "/v1/completions", json=stream) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            lp = choice["logprobs"] or {}
            tokens += lp.get("tokens", [])
            logprobs += lp.get("token_logprobs", [])
            top += lp.get("top_logprobs", [])
            if len(tokens) >= 3:
                started.set()
    return text, tokens, logprobs, top


def test_decode_worker_killed_mid_stream_answers_go_on_exactly(
    two_by_two: LaunchedServer, reference: list[Any]
) -> None:
    """Every checked request streamed at once; decode-0 is SIGKILLed once tokens flow:
    its requests resume on the other decode worker (or the restarted one) and every
    answer, its logprobs included, is the co-located one."""
    killed_mid_stream(two_by_two, TINY, CHECKED, reference)


def killed_mid_stream(
    server: LaunchedServer, name: str, bodies: list[dict[str, Any]], reference: list[Any]
) -> None:
    """``bodies`` streamed at once with decode-0 SIGKILLed once tokens flow, answering
    ``reference``."""

    async def main() -> list[tuple[Any, ...]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(client, b, started, name)) for b in bodies]
            await asyncio.wait_for(started.wait(), 120)
            os.kill(pid_of(server, "pdserve:decode-0"), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    # A kill may land when decode-0 holds none of the requests (they are short): then
    # the answers must still be exact, and the round is run again, at most three times.
    for _ in range(3):
        got = asyncio.run(main())
        assert [list(g) for g in got] == [list(r) for r in reference]
        wait_all_alive(server)
        if any("resumed" in line for line in server.log):
            break
    assert any("resumed" in line for line in server.log), server.log[-20:]


def _tier_hits(server: LaunchedServer, tier: str) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf'^pdserve_kv_tier_hit_blocks_total\{{tier="{tier}"\}} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_prefixes_back_from_host_ram_and_disk_equal_cold(
    tmp_path: Path, reference: list[Any]
) -> None:
    """A 64-block pool: the 24 others push the checked prompts' blocks out to tier 2 (and
    through it to tier 3); the checked set sent again takes its prefixes from there, and
    after a restart from the disk alone, with the bits of the cold co-located run."""
    flags = (
        f"--colocated 1 --device cpu --kv-cache-tokens 1024 --max-model-len 512 {DET}"
        f" --served-model-name {TINY} --kv-offload-dir {tmp_path}"
    )
    with serving(flags) as server:
        assert one_at_a_time(server, TINY, CHECKED) == reference
        all_at_once(server, TINY, [], OTHERS)  # evicts the checked prompts' blocks
        assert one_at_a_time(server, TINY, CHECKED) == reference
        assert _tier_hits(server, "host") > 0
    with serving(flags) as server:  # stopped with SIGTERM: tier 3 was flushed
        assert one_at_a_time(server, TINY, CHECKED) == reference
        assert _tier_hits(server, "disk") > 0


def test_packed_default_across_topologies_death_and_tiers(tmp_path: Path) -> None:
    """SmolLM2 served packed (GGUF Q4_1, pdserve's fused CPU kernels): the greedy set one
    at a time on a co-located server with a 64-block pool and n-gram speculation is the
    reference; the same server gives it again after the 24 others pushed its prefixes
    out to tier 2, and after a restart from tier 3; ``--prefill 1 --decode 2`` without
    speculation gives it one at a time, among the 24 others, and while decode-0 is
    SIGKILLed mid-stream."""
    name, vocab = "smol", 49_000
    greedy = checked_bodies(16, 2, vocab)
    others = background_bodies(24, 3, vocab)
    colocated = (
        f"--colocated 1 --device cpu --kv-cache-tokens 1024 --max-model-len 512 {DET}"
        f" --served-model-name {name} --kv-offload-dir {tmp_path}"
        f" --speculative-config {shlex.quote(NGRAM_CONFIG)}"
    )
    with serving(colocated, tiny_model=False) as server:
        reference = one_at_a_time(server, name, greedy)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        accepted = re.findall(
            r"pdserve_spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)", metrics
        )
        assert sum(float(v) for v in accepted) > 0, metrics[-2000:]  # drafts were taken
        all_at_once(server, name, [], others)  # evicts the greedy prompts' blocks
        assert one_at_a_time(server, name, greedy) == reference
        assert _tier_hits(server, "host") > 0
    with serving(colocated, tiny_model=False) as server:  # stopped with SIGTERM: tier 3 kept
        assert one_at_a_time(server, name, greedy) == reference
        assert _tier_hits(server, "disk") > 0
    split = f"--prefill 1 --decode 2 --device cpu --served-model-name {name} {DET}"
    with serving(split, tiny_model=False) as server:
        wait_all_alive(server)  # serving is printed before the decode workers have loaded
        assert one_at_a_time(server, name, greedy) == reference
        assert all_at_once(server, name, greedy, others) == reference
        killed_mid_stream(server, name, greedy, reference)
