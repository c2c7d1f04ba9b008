"""An idle server costs (almost) nothing: every process sleeps in the kernel.

Measured two ways over 10 s: how often the tree's threads wake (context switches: a poll
loop of 1 ms would switch ~1000 times a second, the idle tree about 35: each worker's
heartbeat ~2.5/s, the frontend's timers ~17/s), and the CPU it uses (a spinning process
takes a whole core). The wakeups carry the claim; the CPU bound, 15 % of one core, only
catches a spin without system calls: on a 2-core Xeon VM the same idle tree measured
1.3-5.8 % of a core (4.9 % in a full suite run, other test servers up beside it), from its
heartbeats and timers alone, where an AMD EPYC measured under 2 %."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from tests.conftest import LaunchedServer
from tests.e2e.helpers import children, title


def _switches(pids: list[int]) -> int:
    """Context switches, voluntary or not, of every thread of ``pids``."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def _cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _settled(pids: list[int], timeout_s: float = 60.0) -> None:
    """Wait until ``pids`` use no CPU for a second (bounded: the test then measures)."""
    deadline = time.monotonic() + timeout_s
    last = _cpu_seconds(pids)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _cpu_seconds(pids)
        if now == last:
            return
        last = now


def test_idle_server_sleeps_in_the_kernel(server: LaunchedServer) -> None:
    pids = [server.proc.pid, *children(server.proc.pid)]
    # launcher, the zygote, frontend, 2 prefill, 2 decode, 2 detok
    assert len(pids) == 1 + 1 + 1 + 2 + 2 + 2
    # The frontend's grammar compile processes (its children) must sleep too, once loaded.
    # The first constrained request starts one (unless an earlier test's did already).
    body = {
        "messages": [{"role": "user", "content": "A JSON object, please."}],
        "max_tokens": 4,
        "response_format": {"type": "json_object"},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    grammar = [g for pid in pids[1:] for g in children(pid) if title(g) == "pdserve:grammar"]
    assert grammar
    pids += grammar
    time.sleep(3.0)  # let any request of an earlier test finish
    _settled(grammar)  # a grammar process still loading its library is not idle yet
    before = {pid: _cpu_seconds([pid]) for pid in pids}
    switched = {pid: _switches([pid]) for pid in pids}
    t0 = time.monotonic()
    time.sleep(10.0)
    used = {pid: _cpu_seconds([pid]) - before[pid] for pid in pids}
    woke = {pid: _switches([pid]) - switched[pid] for pid in pids}
    elapsed = time.monotonic() - t0
    share = sum(used.values()) / elapsed
    rate = sum(woke.values()) / elapsed
    detail = {
        title(pid): (round(100 * used[pid] / elapsed, 2), round(woke[pid] / elapsed, 1))
        for pid in pids
    }
    # (% of a core, switches a second) by process
    assert rate < 100, f"idle server woke {rate:.0f} times a second: {detail}"
    assert share < 0.15, f"idle server used {100 * share:.1f}% of one core: {detail}"


def test_process_titles_name_each_role(server: LaunchedServer) -> None:
    titles = set()
    for pid in children(server.proc.pid):
        titles.add(title(pid))
    want = {
        "pdserve:frontend-0",
        "pdserve:prefill-0",
        "pdserve:prefill-1",
        "pdserve:decode-0",
        "pdserve:decode-1",
        "pdserve:detok-0",
        "pdserve:detok-1",
        "pdserve:zygote",
    }
    assert {t.strip() for t in titles} == want


def test_the_launcher_never_loads_torch(server: LaunchedServer) -> None:
    """Serving (memory plan, segments, tiers, supervision) and after: no libtorch mapped."""
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps
