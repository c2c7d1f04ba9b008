"""Worker deaths and stalls under load: every stream continues exactly, never hangs.

One server (2 prefill, 2 decode, 2 detokenizer shards) takes the worker deaths and a
SIGSTOP in turn; a second one is used up by the frontend-death test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import LaunchedServer
from tests.e2e.helpers import children, title

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def victim() -> Iterator[LaunchedServer]:
    srv = LaunchedServer(
        ["--prefill", "2", "--decode", "2", "--detokenizers", "2", "--device", "cpu",
         "--kv-cache-tokens", "8192", "--max-model-len", "1024", "--stall-timeout", "4"]
    )  # fmt: skip
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuations from transformers, computed once per prompt on demand."""
    return {}


def _want(reference: dict[tuple[int, ...], list[int]], model: Path, prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in reference:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None)  # fmt: skip
        reference[key] = out[0, len(prompt) :].tolist()
    return reference[key]


def _pid_of(server: LaunchedServer, name: str) -> int:
    for pid in children(server.proc.pid):
        if title(pid) == name:
            return pid
    raise AssertionError(f"no process titled {name}")


async def _stream(client: httpx.AsyncClient, prompt: list[int], started: asyncio.Event) -> dict:  # type: ignore[type-arg]
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    text, ids, finish = "", [], None
    async with client.stream("POST", "/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["text"]
            ids += chunk["output_ids"]
            finish = chunk.get("finish_reason") or finish
            if len(ids) >= 8:
                started.set()
    return {"text": text, "ids": ids, "finish": finish}


def _run_with_kill(server: LaunchedServer, prompts: list[list[int]], *titles: str) -> list[dict]:  # type: ignore[type-arg]
    async def main() -> list[dict]:  # type: ignore[type-arg]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(client, p, started)) for p in prompts]
            await asyncio.wait_for(started.wait(), 60)
            for title in titles:
                os.kill(_pid_of(server, title), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 100)

    return asyncio.run(main())


def _check_exact(results: list[dict], prompts: list[list[int]], reference: dict,  # type: ignore[type-arg]
                 model: Path, tokenizer: object, log: list[str]) -> None:  # fmt: skip
    events = [line for line in log if "resumed" in line or "exited" in line or "failed" in line]
    for prompt, result in zip(prompts, results, strict=True):
        want = _want(reference, model, prompt)
        assert result["finish"] == "length", (result, events[-20:])
        assert result["ids"] == want, f"prompt of {len(prompt)}: {events[-20:]}"
        assert result["text"] == tokenizer.decode(want, skip_special_tokens=True)  # type: ignore[attr-defined]


def _wait_all_alive(server: LaunchedServer, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(w["alive"] for w in server.health()["workers"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"workers not all back: {server.health()}")


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150_000, (5 + 9 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("title", ["pdserve:decode-0", "pdserve:prefill-1"])
def test_worker_death_mid_stream_loses_and_duplicates_nothing(
    victim: LaunchedServer,
    reference: dict,
    default_model_path: Path,
    qwen_tokenizer,
    title: str,  # type: ignore[no-untyped-def, type-arg]
) -> None:
    _wait_all_alive(victim)
    prompts = _prompts(6, seed=len(title))
    results = _run_with_kill(victim, prompts, title)
    _check_exact(results, prompts, reference, default_model_path, qwen_tokenizer, victim.log)
    _wait_all_alive(victim)  # the launcher restarted it and it serves again


@pytest.mark.parametrize("shards", [("pdserve:detok-0",), ("pdserve:detok-0", "pdserve:detok-1")])
def test_detokenizer_deaths_lose_and_duplicate_nothing(
    victim: LaunchedServer,
    reference: dict,  # type: ignore[type-arg]
    default_model_path: Path,
    qwen_tokenizer: object,
    shards: tuple[str, ...],
) -> None:
    _wait_all_alive(victim)
    prompts = _prompts(8, seed=99 + len(shards))
    results = _run_with_kill(victim, prompts, *shards)
    _check_exact(results, prompts, reference, default_model_path, qwen_tokenizer, victim.log)
    _wait_all_alive(victim)


def test_a_stopped_decode_worker_is_reported_and_its_streams_finish_elsewhere(
    victim: LaunchedServer,
    reference: dict,  # type: ignore[type-arg]
    default_model_path: Path,
    qwen_tokenizer: object,
) -> None:
    _wait_all_alive(victim)
    prompts = _prompts(8, seed=7)
    pid = _pid_of(victim, "pdserve:decode-0")
    seen: list[str] = []

    async def main() -> list[dict]:  # type: ignore[type-arg]
        async with httpx.AsyncClient(base_url=victim.url, timeout=120) as client:
            started = asyncio.Event()
            tasks = [asyncio.create_task(_stream(client, p, started)) for p in prompts]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(pid, signal.SIGSTOP)
            try:
                while not all(task.done() for task in tasks):
                    health = (await client.get("/health")).json()
                    seen.extend(f"{w['role']}-{w['index']}" for w in health["workers"]
                                if w["state"] == "stalled")  # fmt: skip
                    await asyncio.sleep(0.2)
                return await asyncio.wait_for(asyncio.gather(*tasks), 100)
            finally:
                os.kill(pid, signal.SIGCONT)

    results = asyncio.run(main())
    assert "decode-0" in seen  # /health said which worker stalled
    _check_exact(results, prompts, reference, default_model_path, qwen_tokenizer, victim.log)
    _wait_all_alive(victim)  # it rejoined once it could run again
    assert _pid_of(victim, "pdserve:decode-0") == pid  # the same process, not a restart


def test_frontend_death_stops_everything(default_model_path: Path) -> None:
    srv = LaunchedServer(["--prefill", "1", "--decode", "1", "--device", "cpu",
                          "--kv-cache-tokens", "4096"])  # fmt: skip
    srv.wait_ready()
    kids = children(srv.proc.pid)
    os.kill(_pid_of(srv, "pdserve:frontend"), signal.SIGKILL)
    code = srv.proc.wait(30)
    assert code != 0
    time.sleep(0.5)
    assert not [pid for pid in kids if Path(f"/proc/{pid}").exists()]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("pdserve.")]
