"""``launch --cpu-affinity`` on a launched CPU tree: where each process may run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.harness.processes import titled_tree
from engine.kernels.cpu.ops import bind_threads_op
from tests.conftest import LaunchedServer

CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to keep apart")


def _masks(pid: int) -> dict[int, list[int]]:
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def _serve(srv: LaunchedServer) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    r = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


@pytest.fixture(scope="module")
def pinned() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving("--colocated 1 --device cpu --kv-cache-tokens 4096")


def test_the_worker_main_thread_keeps_home_and_the_rest_keep_off_it(
    pinned: LaunchedServer,
) -> None:
    _serve(pinned)
    tree = titled_tree(pinned.proc.pid)
    worker = _masks(tree["pdserve:colocated-0"])
    assert worker.pop(tree["pdserve:colocated-0"]) == [CORES[0]]
    if bind_threads_op() is not None:  # its OpenMP pool: one thread on each other core
        for core in CORES[1:]:
            assert [core] in worker.values(), core
    # Threads it started before it placed them (the step beat's) still run anywhere.
    assert CORES in worker.values()
    for name in ("pdserve:detok-0", "pdserve:frontend-0"):
        assert set(map(tuple, _masks(tree[name]).values())) == {tuple(CORES[1:])}, name


def test_off_leaves_every_process_to_the_scheduler() -> None:
    args = "--colocated 1 --device cpu --kv-cache-tokens 4096 --cpu-affinity off"
    srv = LaunchedServer(args.split())
    srv.wait_ready()
    try:
        _serve(srv)
        for name, pid in titled_tree(srv.proc.pid).items():
            assert all(mask == CORES for mask in _masks(pid).values()), name
    finally:
        srv.stop()
