"""What serving adds on top of the engine: HTTP + rings + KV handoff + detokenizer.

Side by side in one run, on the default tiny model and CPU:

* in-process: ``engine.runner.ModelRunner`` directly, torch threads as launch gives a worker;
  one decode step (forward + greedy sample) at batch 16, and a prefill (+ first-token
  sample) of one prompt as long as the served prompt;
* served: ``launch --prefill 1 --decode 1`` on a free port; inter-token latency (gap
  between SSE content chunks) with 16 concurrent streams, and time to first token with
  one request at a time.

Reports ITL p50 / in-process decode step (target <= 1.3x) and TTFT p50 - in-process
prefill p50 (target <= 5 ms).

    python -m benchmarks.serving_overhead [--quick]

Writes benchmarks/results/serving_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.machine import describe as describe_machine
from engine.config import EngineConfig
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from pdserve import tiny_models

RESULTS = Path(__file__).parent / "results" / "serving_overhead.md"
PROMPT = "The quick brown fox jumps over the lazy dog while the engineers measure latency."
CONCURRENCY = 16
MAX_TOKENS = 64


@dataclass(frozen=True)
class Served:
    itl_ms: list[float]  # every gap between consecutive content chunks, all streams
    ttft_ms: list[float]  # one request at a time
    prompt_tokens: int


class Server:
    """A real ``launch`` process tree on a free loopback port (as tests/conftest does)."""

    def __init__(self, args: list[str]) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "launcher.cli", "--port", str(port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        ready = threading.Event()

        def pump() -> None:  # keeps draining the pipe so the server never blocks on logs
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if "pdserve is serving" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("launch did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def stream_one(
    client: httpx.AsyncClient, model: str, max_tokens: int
) -> tuple[list[float], int]:
    """Arrival times (perf_counter, s) of each content chunk, and the prompt's token count."""
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    times = [time.perf_counter()]
    prompt_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                prompt_tokens = int(payload["usage"]["prompt_tokens"])
            if any(c.get("text") for c in payload.get("choices") or []):
                times.append(time.perf_counter())
    return times, prompt_tokens


async def measure_served(url: str, rounds: int, ttft_requests: int) -> Served:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await stream_one(client, model, 4)  # warm-up
        itl: list[float] = []
        for _ in range(rounds):
            results = await asyncio.gather(
                *(stream_one(client, model, MAX_TOKENS) for _ in range(CONCURRENCY))
            )
            for times, _ in results:
                itl += [(b - a) * 1e3 for a, b in itertools.pairwise(times[1:])]
        ttft, prompt_tokens = [], 0
        for _ in range(ttft_requests):
            times, prompt_tokens = await stream_one(client, model, 1)
            ttft.append((times[1] - times[0]) * 1e3)
    return Served(itl, ttft, prompt_tokens)


def in_process(model: Path, prompt_tokens: int, repeats: int) -> tuple[list[float], list[float]]:
    """Per-step decode+sample times at batch 16, and prefill+sample times, in ms."""
    # NOTE: the launcher gives each of the 2 workers cores // 2 OpenMP threads; so do we.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    runner = ModelRunner(EngineConfig(model=str(model)))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 150_000, (prompt_tokens,), generator=g).tolist()
    prefill = []
    for i in range(-2, repeats):  # two untimed warm-up rounds
        seq = Sequence(i, prompt, sampling=greedy, block_size=runner.block_size)
        t0 = time.perf_counter()
        runner.sample(runner.prefill([(seq, seq.num_tokens)]), [seq])
        if i >= 0:
            prefill.append((time.perf_counter() - t0) * 1e3)
        runner.free_blocks(seq)
    seqs = [Sequence(i, prompt, sampling=greedy, block_size=runner.block_size) for i in range(16)]
    first = runner.sample(runner.prefill([(s, s.num_tokens) for s in seqs]), seqs)
    for s, t in zip(seqs, first.token_ids.tolist()):
        s.append_token(int(t))
    decode = []
    for _ in range(MAX_TOKENS - 1):
        t0 = time.perf_counter()
        out = runner.sample(runner.decode(seqs), seqs)
        decode.append((time.perf_counter() - t0) * 1e3)
        for s, t in zip(seqs, out.token_ids.tolist()):
            s.append_token(int(t))
    return decode, prefill


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def report(served: Served, decode: list[float], prefill: list[float], cmd: str) -> str:
    itl50, step50 = pct(served.itl_ms, 50), statistics.median(decode)
    ttft50, pre50 = pct(served.ttft_ms, 50), statistics.median(prefill)
    rows = [
        ("ITL p50, 16 streams (served)", f"{itl50:.2f} ms"),
        ("ITL p90, 16 streams (served)", f"{pct(served.itl_ms, 90):.2f} ms"),
        ("decode step p50, batch 16 (in-process, forward + sample)", f"{step50:.2f} ms"),
        ("**ITL p50 / decode step p50** (target <= 1.3)", f"**{itl50 / step50:.2f}x**"),
        (f"TTFT p50, one at a time, {served.prompt_tokens}-token prompt", f"{ttft50:.2f} ms"),
        ("prefill p50, same length (in-process, forward + sample)", f"{pre50:.2f} ms"),
        ("**TTFT p50 - prefill p50** (target <= 5 ms)", f"**{ttft50 - pre50:.2f} ms**"),
    ]
    lines = ["# Serving overhead: launched 1P+1D vs the engine in-process (CPU, tiny model)", "",
             f"Command: `{cmd}`", "", "| measurement | value |", "| --- | ---: |"]  # fmt: skip
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += [
        "",
        f"Samples: {len(served.itl_ms)} inter-token gaps, {len(served.ttft_ms)} TTFTs, "
        f"{len(decode)} decode steps, {len(prefill)} prefills. Served side: "
        f"`launch --prefill 1 --decode 1 --detokenizers 1 --device cpu`, /v1/completions "
        f"streaming, max_tokens {MAX_TOKENS}, ignore_eos, temperature 0.",
        "",
        "Machine:",
        "```",
        describe_machine(),
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = tiny_models.tiny_model_dir()
    rounds, ttfts = (1, 5) if args.quick else (3, 20)
    server = Server(["--prefill", "1", "--decode", "1", "--detokenizers", "1", "--device", "cpu"])
    try:
        server.wait_ready()
        served = asyncio.run(measure_served(server.url, rounds, ttfts))
    finally:
        server.stop()
    decode, prefill = in_process(model, served.prompt_tokens, ttfts)
    cmd = "python -m benchmarks.serving_overhead" + (" --quick" if args.quick else "")
    text = report(served, decode, prefill, cmd)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
