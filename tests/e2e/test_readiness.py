"""Ready means serving: from the first 200 of ``/health`` on, a request is served.

Polls ``/health`` from the moment ``launch`` starts. Before every role has a ready worker
the answer is 503 (or no answer at all); every 200 lists a ready worker of every role the
launch started; a completion sent the instant ``/health`` first turns 200 is served, not
refused with a 503.
"""

from __future__ import annotations

import shlex
import threading
import time

import httpx

from tests.conftest import LaunchedServer


def test_the_first_200_of_health_already_serves() -> None:
    # The real default model: its workers take seconds to load after the frontend and the
    # detokenizer shards serve, the window in which /health used to say "ok" while no
    # engine worker had yet shown up in the load table.
    srv = LaunchedServer(
        shlex.split("--prefill 2 --decode 2 --detokenizers 2 --device cpu --kv-cache-tokens 4096"),
        tiny_model=False,
    )
    assert srv.proc.stdout is not None
    threading.Thread(target=lambda: srv.log.extend(srv.proc.stdout or ()), daemon=True).start()
    try:
        seen: list[int] = []
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            while time.monotonic() < deadline:
                assert srv.proc.poll() is None, "".join(srv.log[-30:])
                try:
                    r = c.get("/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                seen.append(r.status_code)
                if r.status_code == 200:
                    break
                # "unresponsive": the accept thread answers before the loop's first report.
                assert r.status_code == 503, r.text
                assert r.json()["status"] in ("unavailable", "unresponsive"), r.text
                time.sleep(0.02)
            assert seen and seen[-1] == 200, seen
            body = r.json()
            served = {w["role"] for w in body["workers"] if w["alive"]}
            assert served == {"prefill", "decode", "detokenizer", "frontend"}, body
            model = c.get("/v1/models").json()["data"][0]["id"]
            reply = c.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": "Hello",
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
