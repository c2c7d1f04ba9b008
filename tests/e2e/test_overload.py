"""500 streaming clients at once against a small admission bound.

Beyond the bound the server answers 503 + Retry-After with an OpenAI-shaped error, every
admitted stream runs to its end, /health answers 200 throughout, and the frontend's memory
stays within 100 MiB of where it was.
/health is probed from a separate process so the 500 clients' own event loop cannot
inflate the latencies it sees.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.processes import rss_bytes
from benchmarks.serving.overload import CLIENTS, LAUNCH_ARGS, Probe, percentile, storm
from tests.conftest import LaunchedServer
from tests.e2e.helpers import pid_of

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def small() -> Iterator[LaunchedServer]:
    srv = LaunchedServer(list(LAUNCH_ARGS))  # an admission bound of 8 waiting requests
    srv.wait_ready()
    yield srv
    srv.stop()


def test_500_streams_beyond_the_bound_get_503_and_health_keeps_answering(
    small: LaunchedServer,
) -> None:
    frontend = pid_of(small, "pdserve:frontend-0")
    rss_before = rss_bytes(frontend)
    probe = Probe(small.port)
    results = asyncio.run(storm(small.url, CLIENTS))
    latencies, codes = probe.stop()

    refused = [r for r in results if r["status"] == 503]
    served = [r for r in results if r["status"] == 200]
    assert len(refused) + len(served) == CLIENTS, {r["status"] for r in results}
    assert refused and served
    for r in refused:
        headers = r["headers"]
        assert isinstance(headers, dict) and int(headers["retry-after"]) >= 1
        error = json.loads(str(r["body"]))["error"]
        assert error["code"] == "overloaded" and error["type"] == "server_error"
        assert isinstance(error["message"], str) and error["message"]
    for r in served:
        assert r["done"] and r["finish"] == "length", r

    assert rss_bytes(frontend) - rss_before < 100 * 2**20
    # Liveness, not speed (the suite asserts no timings): every probe got a 200 within its
    # 5 s socket timeout. The latencies go to the log; see benchmarks/results/overload.md for
    # the measured p99 against the 100 ms target.
    assert set(codes) == {"HTTP/1.1 200 OK"}, codes
    logger.info(
        "/health over %d probes: p50 %.0f ms, p99 %.0f ms, max %.0f ms",
        len(latencies),
        1000 * percentile(latencies, 0.5),
        1000 * percentile(latencies, 0.99),
        1000 * max(latencies),
    )
    assert small.health()["status"] == "ok"
    # Every refusal is counted, and the probes were answered by the accept thread.
    counters = {}
    for line in httpx.get(small.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("pdserve_requests_refused_total", "pdserve_health_probes_answered")):
            name, value = line.split()
            counters[name] = float(value)
    assert counters["pdserve_requests_refused_total"] == len(refused)
    assert counters["pdserve_health_probes_answered_total"] >= len(latencies)


def test_after_the_storm_the_server_serves_and_holds_no_kv(small: LaunchedServer) -> None:
    from benchmarks.serving.soak import wait_quiet

    assert not any(wait_quiet(small.url, timeout_s=30).values())
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(small.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert Path(f"/proc/{pid_of(small, 'pdserve:frontend-0')}").exists()
