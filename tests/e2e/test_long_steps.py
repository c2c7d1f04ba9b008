"""A worker inside one step longer than the router's staleness bound is busy, not dead.

The bound is a quarter of ``--stall-timeout``; here 0.5 s, under one prefill step of a
~3.5k-token prompt of the default model on a CPU (seconds). Before the step heartbeat
(runtime/step_beat.py) the lone prefill worker read as stale for most of that step: /health
called it stalled and a request sent meanwhile got 503 "no live prefill worker".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LaunchedServer

ARGS = (
    "--prefill 1 --decode 1 --detokenizers 1 --device cpu --kv-cache-tokens 16384 "
    "--max-model-len 4096 --chunked-prefill-size 4096 --stall-timeout 2"
)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 350  # ~3.5k tokens


@pytest.fixture(scope="module")
def long_steps() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(ARGS, tiny_model=False)


def _complete(url: str, prompt: str, out: dict[str, int], key: str) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    out[key] = r.status_code


def test_a_long_prefill_step_keeps_its_worker_routable(long_steps: LaunchedServer) -> None:
    codes: dict[str, int] = {}
    sent = time.monotonic()
    long = threading.Thread(target=_complete, args=(long_steps.url, LONG_PROMPT, codes, "long"))
    long.start()
    short = threading.Thread(target=_complete, args=(long_steps.url, "Hello", codes, "short"))
    stalled: list[str] = []
    short_started = False
    deadline = sent + 60
    # Until both requests end (bounded): every 0.1 s, what /health says of each worker;
    # 1 s in (the long prompt's step under way), a short request, which needs the prefill
    # worker too.
    while (long.is_alive() or short.is_alive()) and time.monotonic() < deadline:
        if not short_started and time.monotonic() > sent + 1:
            short.start()
            short_started = True
        health = httpx.get(long_steps.url + "/health", timeout=5).json()
        stalled += [
            f"{w['role']}-{w['index']}"
            for w in health.get("workers", ())
            if w["state"] == "stalled"
        ]
        time.sleep(0.1)
    long.join(timeout=60)
    if short_started:
        short.join(timeout=60)
    assert codes == {"long": 200, "short": 200}, codes
    assert not stalled, stalled
