"""``launch --colocated 2``: the co-located baseline server, end to end."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LaunchedServer
from tests.e2e.helpers import (
    check_abort_mid_stream_frees_kv,
    check_greedy_matches_transformers,
    kv_in_use,
    random_prompts,
)


@pytest.fixture(scope="module")
def colocated_server() -> Iterator[LaunchedServer]:
    yield from LaunchedServer.serving(
        "--colocated 2 --detokenizers 1 --device cpu --kv-cache-tokens 8192 --max-model-len 1024"
    )


def test_workers_are_colocated_processes(colocated_server: LaunchedServer) -> None:
    workers = colocated_server.health()["workers"]
    colocated = sorted(w["index"] for w in workers if w["role"] == "colocated")
    assert colocated == [0, 1]
    assert not [w for w in workers if w["role"] in ("prefill", "decode")]
    assert all(w["alive"] for w in workers)
    for w in workers:
        if w["role"] == "colocated":
            title = subprocess.run(
                ["ps", "-o", "args=", "-p", str(w["pid"])], capture_output=True, text=True
            ).stdout.strip()
            assert title == f"pdserve:colocated-{w['index']}"


def test_concurrent_greedy_requests_match_transformers(
    colocated_server: LaunchedServer, default_model_path: Path
) -> None:
    prompts = random_prompts(12, seed=5, first=1, step=11)
    check_greedy_matches_transformers(colocated_server, default_model_path, prompts, max_tokens=12)


def test_abort_mid_stream_frees_kv(colocated_server: LaunchedServer) -> None:
    check_abort_mid_stream_frees_kv(colocated_server)


def test_stop_string_ends_the_request_early(colocated_server: LaunchedServer) -> None:
    """The shard's stop notice reaches the co-located worker (stop.k0.c{c}) and frees KV."""
    ids = [1000 + i for i in range(8)]
    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=colocated_server.url, timeout=120) as client:
        full = client.post("/generate", json={"input_ids": ids, "sampling_params": params})
        text = full.json()["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip()
        r = client.post(
            "/generate", json={"input_ids": ids, "sampling_params": {**params, "stop": [stop]}}
        )
    out = r.json()
    assert out["finish_reason"] == "stop" and out["text"] == text[: text.index(stop)]
    deadline = time.monotonic() + 5
    while kv_in_use(colocated_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_in_use(colocated_server) == 0
