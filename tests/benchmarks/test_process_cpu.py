"""``benchmarks.serving.load_ab``'s CPU per process kind, on a launched tree."""

from __future__ import annotations

import httpx

from benchmarks.harness.processes import cpu_seconds, titled_tree
from benchmarks.serving.load_ab import _role_cpu
from tests.conftest import LaunchedServer


def test_each_role_of_a_launched_tree_is_found_and_its_cpu_grows_with_work() -> None:
    srv = LaunchedServer(["--colocated", "1", "--device", "cpu", "--kv-cache-tokens", "4096"])
    srv.wait_ready()
    try:
        titles = set(titled_tree(srv.proc.pid))
        assert {"pdserve:colocated-0", "pdserve:detok-0", "pdserve:frontend-0"} <= titles
        before = _role_cpu(srv.proc.pid)
        assert {"colocated", "detok", "frontend"} <= set(before)
        body = {"input_ids": list(range(5, 200)), "sampling_params": {"max_tokens": 64}}
        for _ in range(3):
            r = httpx.post(srv.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200
        after = _role_cpu(srv.proc.pid)
        assert after["colocated"] > before["colocated"]
        assert all(after[role] >= before[role] for role in before)
    finally:
        srv.stop()


def test_a_process_that_is_gone_has_no_cpu() -> None:
    assert cpu_seconds(2**22 + 12345) == 0.0  # above any pid_max: never a process
