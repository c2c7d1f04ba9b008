"""One copy of the weights per host: every CPU engine worker maps the same segment.

``launch --prefill 2 --decode 2 --detokenizers 2`` with defaults: each engine worker's
/proc/PID/smaps shows the one weights memfd (same inode), resident in each, and the
tree's PSS of it is at most its size (a page shared by four counts once), while the sum
of the workers' resident pages of it is well above that. Served greedy output equals
transformers'. A SIGKILLed decode worker comes back mapping the same segment, without
reading the checkpoint again. SIGKILL of the whole tree leaves nothing in /dev/shm and
no process holding the segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.processes import process_tree
from benchmarks.serving.tree_memory import WEIGHTS_MAPPING, mapping_usage
from bundled_models import tiny
from tests.conftest import LaunchedServer
from tests.e2e.helpers import (
    check_greedy_matches_transformers,
    concurrent_greedy,
    pid_of,
    random_prompts,
    wait_all_alive,
)

ENGINES = ("pdserve:prefill-0", "pdserve:prefill-1", "pdserve:decode-0", "pdserve:decode-1")
ARGS = "--prefill 2 --decode 2 --detokenizers 2 --device cpu --max-model-len 1024"


def weights_inodes(pid: int) -> set[int]:
    """Inodes of the weights memfd mapped by ``pid`` (/proc/PID/maps, column 5)."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and WEIGHTS_MAPPING in parts[5]:
            out.add(int(parts[4]))
    return out


def holders(inode: int) -> list[int]:
    """Our processes that map or hold an fd of the memfd ``inode``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if inode in weights_inodes(int(entry.name)):
                found.append(int(entry.name))
                continue
            for fd in os.listdir(entry / "fd"):
                if os.stat(entry / "fd" / fd).st_ino == inode:
                    found.append(int(entry.name))
                    break
        except OSError:
            continue  # gone, or not ours
    return found


def check_mapped_once(server: LaunchedServer) -> int:
    """Every engine worker maps one and the same weights segment, and reads it there;
    returns its inode."""
    pids = [pid_of(server, name) for name in ENGINES]
    inodes = [weights_inodes(pid) for pid in pids]
    assert all(len(i) == 1 for i in inodes), dict(zip(ENGINES, inodes, strict=True))
    assert len(set.union(*inodes)) == 1, "workers map different weights segments"
    usage = [mapping_usage(pid, WEIGHTS_MAPPING) for pid in pids]  # (size, rss, pss)
    size = usage[0][0]
    assert all(u[0] == size for u in usage)
    assert all(u[1] > 0 for u in usage), f"a worker reads no weights from the segment: {usage}"
    rss, pss = sum(u[1] for u in usage), sum(u[2] for u in usage)
    # Shared pages are split among their mappers: the tree holds each page once.
    assert pss <= size, (pss, size)
    assert rss > 1.5 * pss, f"the workers' weights pages are not shared: {usage}"
    return next(iter(inodes[0]))


def kill_tree(server: LaunchedServer) -> None:
    """SIGKILL the launcher and every descendant at once: nobody cleans up."""
    tree = process_tree(server.proc.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)


def pdserve_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdserve")}


@pytest.fixture(scope="module")
def shared() -> Iterator[LaunchedServer]:
    before = pdserve_shm()
    srv = LaunchedServer(shlex.split(ARGS))
    srv.wait_ready()
    try:
        yield srv
    finally:
        srv.stop()
    assert pdserve_shm() <= before


def test_every_engine_worker_maps_one_copy_and_serves_transformers_greedy(
    shared: LaunchedServer,
) -> None:
    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    check_greedy_matches_transformers(shared, model, random_prompts(6, seed=3), 12)
    check_mapped_once(shared)
    built = [line for line in shared.log if "weights written to the host's shared" in line]
    assert len(built) == 1, built  # one worker loaded the checkpoint; the rest mapped


def test_a_restarted_worker_maps_the_segment_again(shared: LaunchedServer) -> None:
    inode = check_mapped_once(shared)
    mapped = sum("weights mapped from the host's shared" in line for line in shared.log)
    old = pid_of(shared, "pdserve:decode-1")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if pid_of(shared, "pdserve:decode-1") != old:
                break
        except AssertionError:
            pass
        time.sleep(0.2)
    wait_all_alive(shared)
    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    check_greedy_matches_transformers(shared, model, random_prompts(4, seed=11), 8)
    assert check_mapped_once(shared) == inode
    assert sum("weights mapped from the host's shared" in line for line in shared.log) > mapped
    assert sum("weights written to the host's shared" in line for line in shared.log) == 1


def test_sigkill_of_the_whole_tree_leaves_nothing() -> None:
    before = pdserve_shm()
    srv = LaunchedServer(shlex.split(ARGS))
    srv.wait_ready()
    try:
        inode = check_mapped_once(srv)
    finally:
        kill_tree(srv)
    assert pdserve_shm() <= before
    assert holders(inode) == [], "a process still holds the weights segment"


@pytest.mark.slow
def test_the_packed_default_model_is_mapped_once() -> None:
    """SmolLM2 served packed (int4 + the GEMMs' bfloat16), 2P2D: one copy, and Paris."""
    srv = LaunchedServer(shlex.split("--prefill 2 --decode 2 --detokenizers 2"), tiny_model=False)
    srv.wait_ready()
    try:
        # Enough requests at once that the router gives every worker some.
        prompts = [[100 + (k * 37 + i * 13) % 4000 for i in range(20 + 9 * k)] for k in range(8)]
        asyncio.run(concurrent_greedy(srv.url, prompts, 8))
        body = {
            "model": httpx.get(srv.url + "/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        out = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in out["choices"][0]["message"]["content"]
        check_mapped_once(srv)
    finally:
        kill_tree(srv)
