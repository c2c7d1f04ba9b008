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
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.soak import _rss
from tests.conftest import LaunchedServer
from tests.e2e.test_faults import _pid_of

logger = logging.getLogger(__name__)
CLIENTS = 500
MAX_TOKENS = 4
STORM_TIMEOUT_S = 90.0

# Runs in its own interpreter: GET /health every 50 ms over a fresh raw socket (as a load
# balancer's probe would; an httpx client costs tens of ms per call to build), until a line
# arrives on stdin (at most 100 s); then prints the latencies (s) and status lines.
PROBE = """
import json, select, socket, sys, time
port = int(sys.argv[1])
ask = b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n"
out, codes, end = [], [], time.monotonic() + 100
print("ready", flush=True)
while time.monotonic() < end and not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(ask)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    out.append(time.monotonic() - t0)
    codes.append(reply.split(b"\\r\\n", 1)[0].decode())
    time.sleep(max(0.0, 0.05 - (time.monotonic() - t0)))
print(json.dumps({"latencies": out, "codes": codes}))
"""


@pytest.fixture(scope="module")
def small() -> Iterator[LaunchedServer]:
    srv = LaunchedServer(
        ["--prefill", "1", "--decode", "1", "--detokenizers", "1", "--device", "cpu",
         "--kv-cache-tokens", "2048", "--max-model-len", "256",
         "--max-waiting-requests", "8", "--max-num-seqs", "8"]
    )  # fmt: skip
    srv.wait_ready()
    yield srv
    srv.stop()


async def _stream(client: httpx.AsyncClient, i: int) -> dict[str, object]:
    body = {"prompt": f"request {i}: count to ten", "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            return {"status": r.status_code, "headers": dict(r.headers), "body": raw.decode()}
        finish, done = None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return {"status": 200, "finish": finish, "done": done}


async def _storm(url: str) -> list[dict[str, object]]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        tasks = [_stream(client, i) for i in range(CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*tasks), STORM_TIMEOUT_S)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_500_streams_beyond_the_bound_get_503_and_health_keeps_answering(
    small: LaunchedServer,
) -> None:
    frontend = _pid_of(small, "pdserve:frontend")
    rss_before = _rss(frontend)
    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(small.port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert probe.stdout is not None and probe.stdout.readline() == "ready\n"
    results = asyncio.run(_storm(small.url))
    probed = json.loads(probe.communicate("stop\n", timeout=30)[0])

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

    assert _rss(frontend) - rss_before < 100 * 2**20
    # Liveness, not speed (the suite asserts no timings): every probe got a 200 within its
    # 5 s socket timeout. The latencies go to the log; see benchmarks/results/soak.md for
    # the measured p99 against the 100 ms target.
    assert set(probed["codes"]) == {"HTTP/1.1 200 OK"}, probed["codes"]
    lat = sorted(probed["latencies"])
    logger.info("/health over %d probes: p50 %.0f ms, p99 %.0f ms, max %.0f ms", len(lat),
                1000 * lat[len(lat) // 2], 1000 * _p99(lat), 1000 * lat[-1])  # fmt: skip
    assert small.health()["status"] == "ok"


def test_after_the_storm_the_server_serves_and_holds_no_kv(small: LaunchedServer) -> None:
    from benchmarks.soak import wait_quiet

    assert not any(wait_quiet(small.url, timeout_s=30).values())
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(small.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert Path(f"/proc/{_pid_of(small, 'pdserve:frontend')}").exists()
