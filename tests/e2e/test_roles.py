"""``launch --workers 2``: roles that change while serving, end to end.

Roles are set by hand through POST /roles (``--allow-role-override``), so the test, not
the planner's reading of a loaded machine, decides when they change; the planner's
decisions have their unit tests (``tests/router/test_planner.py``). Every stream is its
prompt's whole greedy continuation (float32, as transformers computes it), whichever
way it was placed and whatever the roles did meanwhile, and no worker restarts.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import (
    Exact,
    greedy_stream,
    pid_of,
    random_prompts,
    reported_pids,
    wait_all_alive,
)

C, P, D = "colocated", "prefill", "decode"


@pytest.fixture(scope="module")
def workers_server() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        "--workers 2 --detokenizers 1 --device cpu --kv-cache-tokens 8192 "
        "--max-model-len 1024 --stall-timeout 4 --allow-role-override"
    )


def _set_roles(server: LaunchedServer, roles: list[str]) -> None:
    r = httpx.post(server.url + "/roles", json={"roles": roles}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"roles": roles}


def _health_roles(server: LaunchedServer) -> list[str]:
    workers = server.health()["workers"]
    return [w["serving_role"] for w in sorted(workers, key=lambda w: w["index"]) if w["role"] == C]


def _metric(server: LaunchedServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{want}\}} (\S+)$", text, re.M)
    assert m is not None, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


def _waves(server: LaunchedServer, prompts: list[list[int]], roles: list[list[str]]) -> list[dict]:  # type: ignore[type-arg]
    """Stream ``prompts`` in ``len(roles)`` waves: before wave k the roles become
    ``roles[k]``, and wave k starts once wave k-1's streams are flowing, so requests
    placed under each set of roles run beside those placed under the others."""
    waves = len(roles)

    async def main() -> list[dict]:  # type: ignore[type-arg]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            tasks: dict[int, asyncio.Task[dict]] = {}  # type: ignore[type-arg]
            for k, wave_roles in enumerate(roles):
                await asyncio.to_thread(_set_roles, server, wave_roles)
                started = asyncio.Event()
                for i in range(k, len(prompts), waves):
                    tasks[i] = asyncio.create_task(greedy_stream(client, prompts[i], started))
                await asyncio.wait_for(started.wait(), 60)
            return await asyncio.wait_for(
                asyncio.gather(*(tasks[i] for i in range(len(prompts)))), 200
            )

    return asyncio.run(main())


def test_roles_change_under_load_and_every_stream_stays_exact(
    workers_server: LaunchedServer, exact: Exact
) -> None:
    server = workers_server
    wait_all_alive(server)
    pids = reported_pids(server)
    assert _health_roles(server) == [C, C]
    prompts = random_prompts(16, seed=60)  # 5 .. 140 tokens: short ones are placed whole
    # Worker 0 goes prefill -> decode -> back; worker 1 the other way.
    results = _waves(server, prompts, [[C, C], [P, D], [D, P], [C, C]])
    exact.check(results, prompts, server.log)
    assert reported_pids(server) == pids  # nothing restarted
    assert _health_roles(server) == [C, C]
    for i in (0, 1):
        assert _metric(server, "pdserve_worker_role_changes_total", index=str(i)) == 3
        assert _metric(server, "pdserve_worker_role", index=str(i), role=C) == 1
        assert _metric(server, "pdserve_worker_role_seconds_total", index=str(i), role=D) > 0
    # Under split roles, long prompts were handed off and short ones placed whole.
    assert _metric(server, "pdserve_placements_total", kind="handoff") > 0
    assert _metric(server, "pdserve_placements_total", kind="local") > 0
    assert _metric(server, "pdserve_placements_total", kind="colocated") > 0
    changes = [line for line in server.log if "role prefill -> decode (set by hand)" in line]
    assert len(changes) == 1  # one log line per change


def test_roles_route_refuses_what_cannot_serve(workers_server: LaunchedServer) -> None:
    for body in ({"roles": [D, D]}, {"roles": [P]}, {"roles": ["both", C]}, {"roles": "x"}):
        r = httpx.post(workers_server.url + "/roles", json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
    assert _health_roles(workers_server) == [C, C]


def test_a_decoder_killed_during_a_role_change_is_recovered(
    workers_server: LaunchedServer, exact: Exact
) -> None:
    server = workers_server
    wait_all_alive(server)
    prompts = random_prompts(6, seed=61, first=40)  # all handed off under split roles

    async def main() -> list[dict]:  # type: ignore[type-arg]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            await asyncio.to_thread(_set_roles, server, [P, D])
            started = asyncio.Event()
            tasks = [asyncio.create_task(greedy_stream(client, p, started)) for p in prompts]
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.to_thread(_set_roles, server, [D, P])  # ... and while it changes:
            os.kill(pid_of(server, "pdserve:colocated-1"), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 200)

    results = asyncio.run(main())
    exact.check(results, prompts, server.log)
    wait_all_alive(server)  # the launcher restarted it, in the role the table holds
    assert _health_roles(server) == [D, P]
    _set_roles(server, [C, C])


@pytest.fixture(scope="module")
def planned_server() -> Iterator[LaunchedServer]:
    """The planner alone sets roles: a TPOT target no CPU step meets, a TTFT target
    every request meets, so its one move is to split the two workers. Two frontends
    share the port: the planner (in frontend 0) judges the requests both finish (8 in
    all, its fewest to judge)."""
    yield from LaunchedServer.serving(
        "--workers 2 --api-workers 2 --detokenizers 1 --device cpu --kv-cache-tokens 8192 "
        "--max-model-len 1024 --slo-tpot-ms 1 --slo-ttft-ms 600000"
    )


def test_the_planner_splits_roles_when_tpot_misses_its_target(
    planned_server: LaunchedServer, exact: Exact
) -> None:
    server = planned_server
    wait_all_alive(server)
    pids = reported_pids(server)
    assert _health_roles(server) == [C, C]
    prompts = random_prompts(8, seed=62)
    first = asyncio.run(_streams(server, prompts))  # the planner's samples
    exact.check(first, prompts, server.log)
    deadline = time.monotonic() + 60
    while _health_roles(server) != [P, D] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _health_roles(server) == [P, D]
    assert any("role colocated -> decode (TPOT" in line for line in server.log)
    second = asyncio.run(_streams(server, prompts))  # placed by the roles it set
    exact.check(second, prompts, server.log)
    assert _metric(server, "pdserve_placements_total", kind="handoff") > 0
    assert reported_pids(server) == pids


async def _streams(server: LaunchedServer, prompts: list[list[int]]) -> list[dict]:  # type: ignore[type-arg]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        started = asyncio.Event()
        tasks = [greedy_stream(client, p, started) for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*tasks), 200)
