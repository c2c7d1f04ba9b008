"""Chaos: random worker SIGKILLs under streaming load; every answer must stay exact.

Launches ``--prefill 2 --decode 2 --detokenizers 2`` (float32, the tiny model) and first
answers each prompt of a fixed pool alone (greedy, one request at a time): the reference.
Then ``--clients`` clients stream greedy completions of random prompts of the pool while,
every ``--interval`` s, one random prefill, decode or detokenizer process is SIGKILLed,
for ``--duration`` s. Every answer must equal its prompt's solo run token for token; no
request may get a 503 or an error; and the process tree must be whole again (every worker
alive in ``/health``) within the launcher's crash-loop back-off cap.

    python -m benchmarks.serving.chaos --duration 80 --out benchmarks/results/chaos.md

The exit status is 0 only if all of that held. ``tests/e2e/test_chaos.py`` runs a short one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.machine import load_average, portable, report_head
from benchmarks.harness.processes import process_tree
from benchmarks.harness.servers import launch
from launcher.supervisor import FAILED_MAX_S

LAUNCH_ARGS = (
    "--prefill 2 --decode 2 --detokenizers 2 --device cpu --dtype float32 "
    "--kv-cache-tokens 16384 --max-model-len 1024"
)
VICTIMS = ("pdserve:prefill-", "pdserve:decode-", "pdserve:detok-")


@dataclass(frozen=True)
class ChaosConfig:
    url: str
    root_pid: int  # the launcher: its process tree holds the victims
    duration_s: float = 80.0
    interval_s: float = 4.0
    clients: int = 12
    prompts: int = 24
    max_tokens: int = 32
    seed: int = 0
    whole_within_s: float = FAILED_MAX_S + 60.0  # the back-off cap, and a restart


@dataclass
class ChaosResult:
    outcomes: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    whole_after_s: float | None = None  # after the last kill; None: not within the cap
    load_before: str = ""
    load_after: str = ""

    @property
    def passed(self) -> bool:
        bad = set(self.outcomes) - {"exact"}
        return not bad and self.outcomes["exact"] > 0 and self.whole_after_s is not None


def prompt_pool(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 4 to 40 random token ids of the tiny model's vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 150_000) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"input_ids": prompt, "stream": stream, "sampling_params": params}


def solo_runs(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output ids, answered alone (nothing else running)."""
    with httpx.Client(base_url=url, timeout=120) as client:
        out = []
        for p in prompts:
            r = client.post("/generate", json=_body(p, max_tokens, stream=False))
            r.raise_for_status()
            out.append(r.json()["output_ids"])
        return out


async def _stream(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> tuple[str, list[int]]:
    """(outcome, output ids) of one streamed request: ``done``, ``503``, ``http N`` or
    ``error: ...``."""
    ids: list[int] = []
    try:
        async with client.stream("POST", "/generate", json=_body(prompt, max_tokens, True)) as r:
            if r.status_code != 200:
                return ("503" if r.status_code == 503 else f"http {r.status_code}"), ids
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                ids += chunk["output_ids"]
                if chunk.get("finish_reason") == "error":
                    return f"error: {chunk.get('error', '')[:120]}", ids
    except httpx.HTTPError as e:
        return f"error: {type(e).__name__}", ids
    return "done", ids


async def _client(
    cfg: ChaosConfig, k: int, want: list[list[int]], res: ChaosResult, end: float
) -> None:
    """Client ``k``: random prompts of the pool, one streamed request at a time."""
    pool = prompt_pool(cfg.prompts, cfg.seed)
    rng = random.Random(cfg.seed * 1000 + k)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=300) as client:
        while time.monotonic() < end:
            i = rng.randrange(len(pool))
            outcome, ids = await _stream(client, pool[i], cfg.max_tokens)
            if outcome == "done":
                outcome = "exact" if ids == want[i] else "mismatch"
                if outcome == "mismatch":
                    res.mismatches.append(f"prompt {i}: got {ids}, want {want[i]}")
            res.outcomes[outcome] += 1
            if outcome == "503":
                await asyncio.sleep(0.5)


def victims(root_pid: int) -> list[tuple[int, str]]:
    """(pid, title) of every prefill, decode and detokenizer process of the tree."""
    out = []
    for pid in process_tree(root_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith(VICTIMS):
            out.append((pid, title.strip()))
    return out


async def _killer(cfg: ChaosConfig, res: ChaosResult, end: float) -> None:
    rng = random.Random(cfg.seed)
    while True:
        await asyncio.sleep(cfg.interval_s)
        if time.monotonic() >= end:
            return
        alive = victims(cfg.root_pid)
        if not alive:
            continue
        pid, title = rng.choice(alive)
        try:
            os.kill(pid, signal.SIGKILL)
            res.kills[title] += 1
        except ProcessLookupError:
            pass


def wait_whole(url: str, timeout_s: float) -> float | None:
    """Seconds until every worker in ``/health`` is alive; None if not within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            workers = httpx.get(url + "/health", timeout=5).json().get("workers", [])
            if workers and all(w["alive"] for w in workers):
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return None


def chaos(cfg: ChaosConfig) -> ChaosResult:
    pool = prompt_pool(cfg.prompts, cfg.seed)
    want = solo_runs(cfg.url, pool, cfg.max_tokens)
    res = ChaosResult(load_before=load_average())

    async def main() -> None:
        end = time.monotonic() + cfg.duration_s
        killer = asyncio.create_task(_killer(cfg, res, end))
        await asyncio.gather(*(_client(cfg, k, want, res, end) for k in range(cfg.clients)))
        await killer

    asyncio.run(main())
    res.whole_after_s = wait_whole(cfg.url, cfg.whole_within_s)
    res.load_after = load_average()
    return res


def report(res: ChaosResult, cfg: ChaosConfig, command: str) -> list[str]:
    lines = report_head("Chaos: random worker SIGKILLs under streaming load", command)
    whole = "never" if res.whole_after_s is None else f"{res.whole_after_s:.1f} s"
    lines += [
        f"{cfg.clients} clients streaming greedy /generate ({cfg.max_tokens} tokens, "
        f"{cfg.prompts} prompts answered alone first as the reference); one random prefill, "
        f"decode or detokenizer process SIGKILLed every {cfg.interval_s:g} s for "
        f"{cfg.duration_s:g} s. Load average before {res.load_before}, after {res.load_after}.",
        "",
        f"Result: {'PASS' if res.passed else 'FAIL'}; the tree whole again {whole} after "
        f"the load (cap {cfg.whole_within_s:.0f} s).",
        "",
        "| outcome | requests |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(res.outcomes.items())),
        "",
        "| killed | times |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(res.kills.items())),
        "",
    ]
    return lines + [f"- {m}" for m in res.mismatches[:10]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=80.0)
    ap.add_argument("--interval", type=float, default=4.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--launch-args", default=LAUNCH_ARGS)
    ap.add_argument("--out", type=Path, default=None, help="write the report (markdown) here")
    a = ap.parse_args(argv)
    proc, url = launch(shlex.split(a.launch_args))
    try:
        cfg = ChaosConfig(url, proc.pid, a.duration, a.interval, a.clients, seed=a.seed)
        res = chaos(cfg)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    command = portable(" ".join(["python -m benchmarks.serving.chaos", *(argv or sys.argv[1:])]))
    text = "\n".join(report(res, cfg, command)) + "\n"
    print(text)
    if a.out is not None:
        a.out.write_text(text)
    return 0 if res.passed else 1


if __name__ == "__main__":
    sys.exit(main())
