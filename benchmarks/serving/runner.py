"""Drive a set of requests at a target arrival process and collect the records."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.serving.client import RequestConfig, send_request
from benchmarks.serving.datasets import SampleRequest
from benchmarks.serving.metrics import RequestRecord


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive: rate in req/s (inf = all at once), gamma burstiness
    (1 = Poisson; lower = burstier), and an optional cap on requests in flight."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


async def arrivals(
    requests: list[SampleRequest], load: LoadConfig
) -> AsyncIterator[tuple[int, SampleRequest]]:
    """Yield (index, request) at gamma-distributed intervals with mean 1 / rate."""
    if load.burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    rng = np.random.default_rng(load.seed)
    theta = 1.0 / (load.request_rate * load.burstiness)
    for i, req in enumerate(requests):
        yield i, req
        if math.isfinite(load.request_rate):
            await asyncio.sleep(float(rng.gamma(shape=load.burstiness, scale=theta)))


async def run_load(
    requests: list[SampleRequest],
    cfg: RequestConfig,
    load: LoadConfig,
    tokenizer: Any,
    disable_tqdm: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Send every request; returns the records (in request order) and the duration.

    A request with ``after`` set (a conversation's next turn) is sent once it has arrived
    and the request it follows has ended, whichever is later; its latencies count from
    then.
    """
    ended = [asyncio.Event() for _ in requests]
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")

    async def one(i: int, req: SampleRequest) -> RequestRecord:
        try:
            if req.after is not None:
                await ended[req.after].wait()
            if limit is None:
                return await _bounded(cfg, req, tokenizer)
            async with limit:
                return await _bounded(cfg, req, tokenizer)
        finally:
            ended[i].set()
            bar.update(1)

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(i, req)) async for i, req in arrivals(requests, load)]
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


async def _bounded(cfg: RequestConfig, req: SampleRequest, tokenizer: Any) -> RequestRecord:
    # The whole request, so a server that trickles bytes forever cannot hang the benchmark.
    try:
        return await asyncio.wait_for(send_request(cfg, req, tokenizer), cfg.timeout_s)
    except TimeoutError:
        return RequestRecord(prompt_len=req.prompt_len, error=f"timed out after {cfg.timeout_s}s")
