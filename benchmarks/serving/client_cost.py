"""What the benchmark client costs the machine it measures on: its transport
(``benchmarks/harness/http_stream.py``) against httpx's streaming client, on one server.

    python -m benchmarks.serving.client_cost [--flags "--colocated 1"] [--tokens 512] \
        [--rounds 6] [--out FILE]

Launches the embedded default model with ``--flags`` and sends one greedy streamed
completion of ``--tokens`` tokens (``ignore_eos``) at a time, alternating the two clients
request by request (a drifting machine hits both alike). Per client: the CPU this process
spent a streamed token (``time.process_time`` around the request over the chunks that
carried text) and the inter-token latency p50, medians over the rounds, and lean / httpx.
On a two-core machine the client's CPU comes off the server's cores. Writes
``benchmarks/results/client_cost.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.machine import load_average, machine_block
from benchmarks.harness.servers import launch
from benchmarks.serving.client import ChunkTiming, RequestConfig, build_body, send_request
from benchmarks.serving.datasets import SampleRequest
from benchmarks.serving.metrics import RequestRecord
from bundled_models.default_model import resolve_model

RESULTS = Path(__file__).parents[1] / "results" / "client_cost.md"
PROMPT = "Write a long story about a lighthouse keeper and the ships she watches."


async def httpx_itl(cfg: RequestConfig, req: SampleRequest) -> list[float]:
    """The same request through httpx, read as the benchmark client read it before
    (``aiter_lines``, then its chunk timing, ``ChunkTiming``): the gaps between text chunks."""
    record = RequestRecord(prompt_len=req.prompt_len)
    timing = ChunkTiming(record, time.perf_counter())
    async with (
        httpx.AsyncClient(timeout=600) as http,
        http.stream("POST", cfg.base_url + cfg.endpoint, json=build_body(cfg, req)) as resp,
    ):
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            timing.on_payload(json.loads(data))
    return record.itl


async def lean_itl(cfg: RequestConfig, req: SampleRequest) -> list[float]:
    record = await send_request(cfg, req, None)
    if not record.success:
        raise RuntimeError(record.error)
    return record.itl


def measure(run: Callable[[], Coroutine[Any, Any, list[float]]]) -> tuple[float, float]:
    """(client CPU us a token, ITL p50 ms) of one request."""
    cpu = time.process_time()
    itl: list[float] = asyncio.run(run())
    return 1e6 * (time.process_time() - cpu) / (len(itl) + 1), 1e3 * statistics.median(itl)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.client_cost", description=__doc__
    )
    p.add_argument("--flags", default="--colocated 1")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    proc, url = launch(["--model", str(resolve_model(None)), *shlex.split(args.flags)])
    clients = {"httpx": httpx_itl, "lean": lean_itl}
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    try:
        cfg = RequestConfig(url, "/v1/completions", resolve_model(None).name, ignore_eos=True)
        req = SampleRequest(PROMPT, 0, args.tokens)
        measure(lambda: lean_itl(cfg, req))  # warm
        for r in range(args.rounds):
            for name in list(clients)[:: 1 if r % 2 == 0 else -1]:
                client = clients[name]
                got[name].append(measure(lambda: client(cfg, req)))  # noqa: B023 (run at once)
                print(name, r, got[name][-1], flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    cpu = {n: statistics.median(c for c, _ in v) for n, v in got.items()}
    itl = {n: statistics.median(i for _, i in v) for n, v in got.items()}
    ratios = [b[1] / a[1] for a, b in zip(got["httpx"], got["lean"])]
    cmd = " ".join(["python -m benchmarks.serving.client_cost", *map(shlex.quote, sys.argv[1:])])
    text = [
        "# The benchmark client's own cost: its transport against httpx's",
        "",
        f"Command: `{cmd}`; the default model, `launch {args.flags}`, one greedy stream of "
        f"{args.tokens} tokens at a time, the clients alternating. Load average at the end: "
        f"{load_average()}.",
        "",
        "| client | client CPU us a token | ITL p50 ms |",
        "|---|---:|---:|",
        *(f"| {n} | {cpu[n]:.0f} | {itl[n]:.2f} |" for n in clients),
        "",
        f"lean / httpx: client CPU {cpu['lean'] / cpu['httpx']:.2f}x, ITL p50 "
        f"{itl['lean'] / itl['httpx']:.2f}x (paired by round: median "
        f"{statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}).",
        "",
        *machine_block(),
    ]
    args.out.write_text("\n".join(text) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
