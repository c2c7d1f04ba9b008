"""Prefix caching through a launched 2P/2D server (issue: prefix caching's done-means).

Two servers side by side, caching on (cache-aware routing, partial KV handoffs) and off:
greedy outputs must be token-identical between them and to transformers on requests
sharing prefixes of many lengths - one ending exactly on a block boundary, one a token
short of it, one a token past it, a prompt repeated whole. Responses report
``usage.prompt_tokens_details.cached_tokens`` on every endpoint, streamed or not, and the
workers' hit rates reach ``/metrics`` and ``/health``.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import LaunchedServer
from tests.e2e.helpers import concurrent_greedy

BS = 16
MAX_TOKENS = 8
_ARGS = shlex.split(
    "--prefill 2 --decode 2 --detokenizers 1 --device cpu --kv-cache-tokens 16384 --max-model-len 1024"
)


@pytest.fixture(scope="session")
def no_caching() -> Iterator[LaunchedServer]:
    """A 2P/2D server with caching off, started before the session's ``server`` fixture
    (same scope, requested first) so the two boot together; not yet ready."""
    srv = LaunchedServer([*_ARGS, "--no-enable-prefix-caching"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def servers(no_caching: LaunchedServer, server: LaunchedServer) -> dict[bool, LaunchedServer]:
    """The session's 2P/2D server (prefix caching and cache-aware routing are its
    defaults) and one like it with caching off."""
    no_caching.wait_ready()
    return {True: server, False: no_caching}


def _prompts() -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(21)
    base = torch.randint(1000, 150_000, (160,), generator=g).tolist()
    tails = iter(torch.randint(1000, 150_000, (200,), generator=g).tolist())
    prompts = [
        base[:n] + [next(tails) for _ in range(k)]
        for n, k in (
            (2 * BS, 5),
            (2 * BS - 1, 9),
            (2 * BS + 1, 3),
            (4 * BS, 1),
            (BS, 20),
            (5 * BS - 1, 17),
            (100, 30),
            (7 * BS, 16),
            (150, 2),
        )
    ]
    prompts += [base[: 6 * BS], list(base), base[:45]]  # whole prefixes, one on a boundary
    return base, prompts


def test_greedy_outputs_match_with_caching_on_and_off_and_transformers(
    servers: dict[bool, LaunchedServer], default_model_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    base, prompts = _prompts()
    got = {}
    for caching, srv in servers.items():
        warm = asyncio.run(concurrent_greedy(srv.url, [base], MAX_TOKENS))  # caches the prefix
        rest = asyncio.run(concurrent_greedy(srv.url, prompts, MAX_TOKENS))
        got[caching] = [r["output_ids"] for r in warm + rest]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rest]
        if caching:
            # Whole blocks of the shared prefix at most (the last token is always computed);
            # a burst spreads over both prefill workers, so some prompts miss.
            for c, p in zip(cached, prompts, strict=True):
                shared = next(i for i in range(len(p) + 1) if i == len(p) or p[i] != base[i])
                assert c % BS == 0 and c <= min(shared, len(p) - 1), (c, shared, len(p))
            assert any(cached), cached
        else:
            assert cached == [0] * len(prompts)
    assert got[True] == got[False]
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    for prompt, ids in zip([base, *prompts], got[True], strict=True):
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )
        assert ids == want[0, len(prompt) :].tolist()


def _sse(r: httpx.Response) -> list[dict]:  # type: ignore[type-arg]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"]


def _prefill_counters(srv: LaunchedServer) -> dict[int, tuple[float, float]]:
    """Each prefill worker's lifetime (prefix-hit tokens, prefix-queried tokens)."""
    return {
        w["index"]: (w["load"]["prefix_hit_tokens"], w["load"]["prefix_queried_tokens"])
        for w in srv.health()["workers"]
        if w["role"] == "prefill"
    }


def test_every_endpoint_reports_cached_prompt_tokens(servers: dict[bool, LaunchedServer]) -> None:
    srv = servers[True]
    text = "The prefix cache keeps what was computed. " * 12
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    before = _prefill_counters(srv)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        common = {"model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        bodies = [
            ("/v1/completions", {**common, "prompt": text}),
            ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}),
        ]
        for path, body in bodies:
            first = c.post(path, json=body).json()["usage"]
            again = c.post(path, json=body).json()["usage"]
            streamed = _sse(c.post(path, json={**body, **stream}))[-1]["usage"]
            assert first["prompt_tokens"] == again["prompt_tokens"] > 4 * BS
            assert again["prompt_tokens_details"]["cached_tokens"] >= 4 * BS, path
            assert streamed["prompt_tokens_details"] == again["prompt_tokens_details"], path
        gen = {"text": text, "sampling_params": {"max_tokens": 4, "temperature": 0}}
        plain = c.post("/generate", json=gen).json()["usage"]
        last = _sse(c.post("/generate", json={**gen, "stream": True}))[-1]["usage"]
        assert plain["prompt_tokens_details"]["cached_tokens"] >= 4 * BS
        assert last["prompt_tokens_details"] == plain["prompt_tokens_details"]
        metrics = c.get("/metrics").text
    rates = re.findall(
        r'^pdserve_prefix_cache_hit_rate\{index="\d",node="[^"]+",role="prefill"\} (\S+)$',
        metrics,
        re.M,
    )
    after = _prefill_counters(srv)
    # /metrics shows each prefill worker's lifetime rate (the session's server has served
    # other tests' traffic); this test's own requests repeat one prompt, so most of what
    # they queried was a hit.
    assert sorted(float(r) for r in rates) == pytest.approx(
        sorted(h / max(q, 1) for h, q in after.values())
    )
    hit = sum(after[k][0] - before[k][0] for k in after)
    queried = sum(after[k][1] - before[k][1] for k in after)
    assert queried > 0 and hit / queried > 0.5, (hit, queried)
    workers = [w for w in srv.health()["workers"] if w["role"] in ("prefill", "decode")]
    assert all(w["load"]["cached_blocks"] > 0 for w in workers), workers
    # A repeated prompt goes back to the decode worker holding it: a partial handoff.
    assert sum(w["load"]["prefix_hit_tokens"] for w in workers if w["role"] == "decode") > 0
