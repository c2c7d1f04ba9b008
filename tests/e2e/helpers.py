"""What several end-to-end tests do to a launched server: drive it and read its state."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from benchmarks.soak import parents
from tests.conftest import LaunchedServer


async def concurrent_greedy(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:  # type: ignore[type-arg]
    """POST every prompt to /generate at once (greedy, ignore_eos); the JSON responses."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(ids: list[int]) -> dict:  # type: ignore[type-arg]
            body = {"input_ids": ids, "sampling_params": {
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            return r.json()  # type: ignore[no-any-return]

        return await asyncio.gather(*(one(p) for p in prompts))


def kv_in_use(server: LaunchedServer) -> int:
    """KV blocks held, summed over every worker (from /health)."""
    used = 0
    for w in server.health()["workers"]:
        load = w["load"]
        if "total_kv_blocks" in load:
            used += int(load["total_kv_blocks"] - load["free_kv_blocks"])
    return used


def check_abort_mid_stream_frees_kv(server: LaunchedServer) -> None:
    """A client that leaves a long stream has its KV back to zero within 5 s."""
    body = {"input_ids": [5] * 40, "stream": True,
            "sampling_params": {"max_tokens": 800, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    with httpx.Client(base_url=server.url) as client:
        with client.stream("POST", "/generate", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 5:
                    assert kv_in_use(server) > 0
                    break  # closing the stream disconnects the client
        deadline = time.monotonic() + 5
        while kv_in_use(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv_in_use(server) == 0


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    return [child for child, parent in parents().items() if parent == pid]


def title(pid: int) -> str:
    """A process's title (its argv[0], as setproctitle sets it)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
