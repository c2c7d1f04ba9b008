"""The loads both servers get, built with ``benchmarks.serving``'s datasets and client.

Every (workload, concurrency) point draws its own prompts (seeded by both), and every
server at that point gets the same ones: no server sees a prompt twice, so neither's
prefix cache is helped by an earlier point.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from benchmarks.peers.report import Point, summary_figures
from benchmarks.serving.client import RequestConfig
from benchmarks.serving.datasets import SampleRequest, mixed_dataset, random_dataset
from benchmarks.serving.metrics import summarize
from benchmarks.serving.runner import LoadConfig, run_load

PERCENTILES = [50.0, 90.0, 99.0]


@dataclass(frozen=True)
class Workload:
    endpoint: str
    dataset: str  # "random" or "mixed" (benchmarks.serving.datasets)
    input_len: int
    output_len: int

    def requests(self, tokenizer: Any, n: int, seed: int) -> list[SampleRequest]:
        if self.dataset == "mixed":
            return mixed_dataset(tokenizer, n, self.input_len, self.output_len, seed)
        return random_dataset(tokenizer, n, self.input_len, self.output_len, 0.0, seed)

    def describe(self) -> str:
        if self.dataset == "mixed":
            return (
                f"`{self.endpoint}`, `mixed` prompts (one user message through the chat "
                f"template): even requests {self.input_len} tokens in / "
                f"{max(1, self.output_len // 8)} out, odd ones {max(4, self.input_len // 8)}"
                f" in / {self.output_len} out; greedy, `ignore_eos`."
            )
        return (
            f"`{self.endpoint}`, `random` prompts of {self.input_len} tokens, "
            f"{self.output_len} output tokens each; greedy, `ignore_eos`."
        )


WORKLOADS = {
    "random": Workload("/v1/completions", "random", 256, 64),
    "chat": Workload("/v1/chat/completions", "mixed", 256, 64),
}


def _run(
    url: str,
    model: str,
    tokenizer: Any,
    w: Workload,
    requests: list[SampleRequest],
    concurrency: int,
    timeout_s: float,
) -> dict[str, Any]:
    cfg = RequestConfig(url, w.endpoint, model, ignore_eos=True, timeout_s=timeout_s)
    load = LoadConfig(max_concurrency=concurrency)
    records, duration = asyncio.run(run_load(requests, cfg, load, tokenizer, disable_tqdm=True))
    return summarize(records, duration, PERCENTILES)


def warm_up(url: str, model: str, tokenizer: Any, concurrency: int, workloads: list[str]) -> None:
    """A short run of each workload at the highest concurrency, with prompts of their own."""
    for name in workloads:
        w = WORKLOADS[name]
        short = Workload(w.endpoint, w.dataset, w.input_len, 16)
        requests = short.requests(tokenizer, concurrency, seed=10_000)
        result = _run(url, model, tokenizer, short, requests, concurrency, 300.0)
        if result["failed"]:
            raise RuntimeError(f"warm-up of {url} failed: {result['errors_summary']}")


def measure(
    server: str,
    url: str,
    model: str,
    tokenizer: Any,
    workload: str,
    concurrency: int,
    n: int,
    timeout_s: float,
) -> Point:
    w = WORKLOADS[workload]
    seed = 1000 * sorted(WORKLOADS).index(workload) + concurrency
    requests = w.requests(tokenizer, n, seed)
    result = _run(url, model, tokenizer, w, requests, concurrency, timeout_s)
    return Point(
        server,
        workload,
        concurrency,
        summary_figures(result),
        result["completed"],
        result["failed"],
        os.getloadavg()[0],
        dict(result["errors_summary"]),
    )
