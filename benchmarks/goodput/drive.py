"""Sending one sweep point: its schedule's requests at their offsets, each streamed and
timed, all bounded by the point's deadline; warming a server and waiting for it to empty.

A point lasts at most its arrival window plus ``drain_s``: requests still running then
are cancelled (the client drops the stream, which aborts them on the server) and judged
on what they showed so far (``Outcome.cut``), so an overloaded configuration costs
bounded time.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from benchmarks.goodput.slo import Outcome
from benchmarks.goodput.traces import CHAT, DOC, Arrival
from benchmarks.serving.client import RequestConfig, send_request
from benchmarks.serving.datasets import SampleRequest, _normal_vocab, random_prompt
from benchmarks.serving.metrics import RequestRecord

UNFINISHED = "unfinished at the point's deadline"


@dataclass(frozen=True)
class Target:
    """The server under test: its base URL and the model name requests carry."""

    base_url: str
    model: str
    api_key: str | None = None


@dataclass(frozen=True)
class Sent:
    """One request of a point: what was asked and what the client measured."""

    arrival: Arrival
    outcome: Outcome
    output_tokens: int
    server_prompt_tokens: int  # as the server's usage reports it; the drawn length if none
    error: str


class Prompts:
    """Prompt texts of exactly the drawn length in the model's tokens (random vocabulary,
    so no two prompts share a cached prefix beyond chance)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = _normal_vocab(tokenizer)
        self.rng = np.random.default_rng(seed)

    def text(self, length: int) -> str:
        return random_prompt(self.tokenizer, self.vocab, length, self.rng)


def _request_config(target: Target, timeout_s: float) -> RequestConfig:
    return RequestConfig(
        target.base_url, "/v1/completions", target.model, True, target.api_key, timeout_s
    )


def _sent(arrival: Arrival, record: RequestRecord, finished: bool) -> Sent:
    if finished:
        outcome = Outcome(record.success, record.ttft, record.tpot)
        return Sent(arrival, outcome, record.output_tokens, record.prompt_len, record.error)
    # Cut at the deadline: judged on its chunks so far (see Outcome.cut).
    chunks = len(record.itl) + (1 if record.ttft else 0)
    tpot = sum(record.itl) / len(record.itl) if record.itl else None
    outcome = Outcome(chunks >= 2, record.ttft, tpot, cut=True)
    return Sent(arrival, outcome, chunks, record.prompt_len, "" if chunks >= 2 else UNFINISHED)


async def run_point(
    target: Target, arrivals: list[Arrival], prompts: Prompts, drain_s: float
) -> list[Sent]:
    """Send ``arrivals`` at their offsets; returns one ``Sent`` each, in arrival order."""
    texts = [prompts.text(a.prompt_len) for a in arrivals]  # built before the clock starts
    window = arrivals[-1].at if arrivals else 0.0
    cfg = _request_config(target, window + drain_s + 30.0)
    start = time.perf_counter()
    tasks, records = [], [RequestRecord(a.prompt_len) for a in arrivals]
    for a, text, record in zip(arrivals, texts, records):
        await asyncio.sleep(max(0.0, start + a.at - time.perf_counter()))
        req = SampleRequest(text, a.prompt_len, a.output_len)
        sending = send_request(cfg, req, prompts.tokenizer, record)
        tasks.append(asyncio.create_task(sending))
    deadline = start + window + drain_s
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    finished = [task.done() for task in tasks]
    for task in tasks:
        task.cancel()  # no-op on the finished ones
    await asyncio.gather(*tasks, return_exceptions=True)
    return [_sent(a, r, done) for a, r, done in zip(arrivals, records, finished)]


async def warm(target: Target, prompts: Prompts, concurrency: int) -> list[str]:
    """Run ``concurrency`` chat and half as many (at least one) document requests at once,
    so every worker has run short and long prompts and decode batches before measuring;
    returns the errors, empty when all served."""
    shapes = [CHAT] * concurrency + [DOC] * max(1, concurrency // 2)
    arrivals = [Arrival(0.0, "warm", s.name, s.prompt[0], s.output[0] // 4) for s in shapes]
    sent = await run_point(target, arrivals, prompts, drain_s=300.0)
    return [s.error for s in sent if s.error]


def busy(health: dict[str, Any]) -> float:
    """Requests a pdserve ``/health`` answer shows in flight (engines and frontends)."""
    total = 0.0
    for w in health.get("workers", []):
        load = w.get("load") or {}
        total += sum(float(load.get(k, 0.0)) for k in ("running_requests", "waiting_requests"))
        total += float(load.get("active_requests", 0.0))
    return total


def wait_quiet(base_url: str, timeout_s: float) -> bool | None:
    """Poll ``/health`` until nothing is in flight: True once quiet, False on timeout,
    None when the server's ``/health`` does not report load (not pdserve)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            doc = httpx.get(base_url.rstrip("/") + "/health", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(doc, dict) or "workers" not in doc:
            return None
        if busy(doc) == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def roles_seen(base_url: str) -> str:
    """What a ``--workers`` server's planner had done by now (``describe_roles``); "" for
    a server that reports no roles."""
    try:
        health = httpx.get(base_url.rstrip("/") + "/health", timeout=10).json()
        metrics = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except (httpx.HTTPError, ValueError):
        return ""
    return describe_roles(health, metrics) if isinstance(health, dict) else ""


def describe_roles(health: dict[str, Any], metrics: str) -> str:
    """Each worker's role now, the role changes and the placements by kind since the
    server started, in words, from its ``/health`` and ``/metrics``; "" without roles."""
    workers = sorted(health.get("workers", []), key=lambda w: w.get("index", 0))
    roles = [str(w["serving_role"]) for w in workers if w.get("serving_role")]
    if not roles:
        return ""
    changes = re.findall(r"^pdserve_worker_role_changes_total\{[^}]*\} (\S+)$", metrics, re.M)
    placed = re.findall(r'^pdserve_placements_total\{kind="(\w+)"\} (\S+)$', metrics, re.M)
    kinds = ", ".join(f"{kind} {float(n):.0f}" for kind, n in placed)
    return (
        f"roles {' / '.join(roles)}; {sum(float(c) for c in changes):.0f} role changes; "
        f"placed {kinds}"
    )
