"""What serving adds on top of the engine: HTTP + rings + KV handoff + detokenizer.

Side by side in one run, on the default tiny model and CPU:

* in-process: ``engine.runner.ModelRunner`` directly, torch threads as launch gives a worker;
  one decode step (forward + greedy sample) at batch 16, and a prefill (+ first-token
  sample) of one prompt as long as the served prompt;
* served: ``launch --prefill 1 --decode 1`` on a free port; inter-token latency (gap
  between SSE content chunks) with 16 concurrent streams, and time to first token with
  one request at a time.

TTFT is taken by two clients on the same requests: a plain keep-alive HTTP/1.1 socket
(the server's own cost: the figure held to the target) and httpx's AsyncClient, which on
this machine adds ~2 ms of its own request building and response parsing. Each served
request is followed by one in-process prefill, so both sides see the same load from the
other jobs sharing the cores (measured minutes apart, they did not).

Reports ITL p50 / in-process decode step (target <= 1.3x) and TTFT p50 - in-process
prefill p50 (target <= 5 ms).

    python -m benchmarks.serving.serving_overhead [--quick]
    python -m benchmarks.serving.serving_overhead --device cuda [--model PATH]   # roles share GPU 0

Writes benchmarks/results/serving_overhead.md (serving_overhead_cuda.md with --device cuda).
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import os
import shlex
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import torch

from benchmarks.harness.cli import quick_parser
from benchmarks.harness.machine import machine_block
from benchmarks.harness.servers import launch
from bundled_models import tiny
from engine.build import build_engine
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from wire.params import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "serving_overhead.md"
RESULTS_CUDA = Path(__file__).parents[1] / "results" / "serving_overhead_cuda.md"
PROMPT = "The quick brown fox jumps over the lazy dog while the engineers measure latency."
CONCURRENCY = 16
MAX_TOKENS = 64


@dataclass
class Measured:
    itl_ms: list[float] = field(default_factory=list)  # every gap between content chunks
    ttft_ms: list[float] = field(default_factory=list)  # plain socket client
    ttft_httpx_ms: list[float] = field(default_factory=list)  # httpx AsyncClient
    prefill_ms: list[float] = field(default_factory=list)  # in-process, interleaved
    decode_ms: list[float] = field(default_factory=list)  # in-process, batch 16
    prompt_tokens: int = 0


def request_body(model: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def parse_sse(line: str) -> tuple[bool, int]:
    """(the event carries text, prompt tokens if it carries usage) for one SSE line."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False, 0
    payload = json.loads(line[6:])
    usage = payload.get("usage") or {}
    has_text = any(c.get("text") for c in payload.get("choices") or [])
    return has_text, int(usage.get("prompt_tokens", 0))


async def stream_one(
    client: httpx.AsyncClient, model: str, max_tokens: int
) -> tuple[list[float], int]:
    """Arrival times (perf_counter, s) of each content chunk, and the prompt's token count."""
    times = [time.perf_counter()]
    prompt_tokens = 0
    body = request_body(model, max_tokens)
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            has_text, tokens = parse_sse(line)
            prompt_tokens = tokens or prompt_tokens
            if has_text:
                times.append(time.perf_counter())
    return times, prompt_tokens


class SocketClient:
    """One keep-alive HTTP/1.1 connection: request bytes out in one send, the response
    parsed by the standard library. Close to the least a client can add to TTFT."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = f"{parts.hostname}:{parts.port}"
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=300)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ttft_ms(self, model: str) -> float:
        """Send one max_tokens=1 request; ms until its first chunk with text (read to end)."""
        payload = json.dumps(request_body(model, 1)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        t0 = time.perf_counter()
        self.sock.sendall(head.encode() + payload)
        resp = http.client.HTTPResponse(self.sock, method="POST")
        resp.begin()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        first: float | None = None
        for line in iter(resp.readline, b""):
            if first is None and parse_sse(line.decode().rstrip("\r\n"))[0]:
                first = time.perf_counter()
        resp.close()
        if first is None:
            raise RuntimeError("the response carried no text")
        return (first - t0) * 1e3

    def close(self) -> None:
        self.sock.close()


class InProcess:
    """The engine alone, with the torch threads launch gives each of the 2 workers."""

    def __init__(self, model: Path, prompt_tokens: int, device: str = "cpu") -> None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
        # On CUDA it shares the GPU with the served workers: a fixed small pool, not a share.
        blocks = None if device == "cpu" else 256
        self.runner = build_engine(
            EngineConfig(model=str(model), device=device, num_kv_blocks=blocks)
        ).runner
        self.cuda = device != "cpu"
        self.greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 1, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        vocab = min(150_000, self.runner.model_config.vocab_size)
        self.prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()

    def _seq(self, rid: int) -> Sequence:
        return Sequence(rid, self.prompt, sampling=self.greedy, block_size=self.runner.block_size)

    def prefill_ms(self) -> float:
        """One prefill (+ first-token sample) of the prompt, in ms."""
        seq = self._seq(0)
        t0 = time.perf_counter()
        self.runner.sample(self.runner.prefill([(seq, seq.num_tokens)]), [seq])
        self._sync()
        elapsed = (time.perf_counter() - t0) * 1e3
        self.runner.kv.free_blocks(seq)
        return elapsed

    def _sync(self) -> None:
        if self.cuda:  # kernels run asynchronously: time them to their end
            torch.cuda.synchronize()

    def decode_steps_ms(self) -> list[float]:
        """Per-step decode + sample times at batch 16, in ms."""
        runner, seqs = self.runner, [self._seq(i) for i in range(16)]
        first = runner.sample(runner.prefill([(s, s.num_tokens) for s in seqs]), seqs)
        for s, t in zip(seqs, first.token_ids.tolist()):
            s.append_token(int(t))
        decode = []
        for _ in range(MAX_TOKENS - 1):
            t0 = time.perf_counter()
            out = runner.sample(runner.decode(seqs), seqs)
            self._sync()
            decode.append((time.perf_counter() - t0) * 1e3)
            for s, t in zip(seqs, out.token_ids.tolist()):
                s.append_token(int(t))
        for s in seqs:
            runner.kv.free_blocks(s)
        return decode


async def measure_itl(client: httpx.AsyncClient, model: str, rounds: int, m: Measured) -> None:
    for _ in range(rounds):
        results = await asyncio.gather(
            *(stream_one(client, model, MAX_TOKENS) for _ in range(CONCURRENCY))
        )
        for times, _ in results:
            m.itl_ms += [(b - a) * 1e3 for a, b in itertools.pairwise(times[1:])]


async def measure_ttft(
    client: httpx.AsyncClient, url: str, model: str, engine: InProcess, n: int, m: Measured
) -> None:
    """n rounds of: one httpx request, one plain-socket request, one in-process prefill.

    NOTE: the socket client and the engine block the event loop; nothing else runs on it.
    """
    sock = SocketClient(url)
    try:
        for i in range(-2, n):  # two untimed warm-up rounds
            times, _ = await stream_one(client, model, 1)
            ttft, prefill = sock.ttft_ms(model), engine.prefill_ms()
            if i >= 0:
                m.ttft_httpx_ms.append((times[1] - times[0]) * 1e3)
                m.ttft_ms.append(ttft)
                m.prefill_ms.append(prefill)
    finally:
        sock.close()


async def measure_served(
    url: str, model_dir: Path, rounds: int, n: int, device: str = "cpu"
) -> tuple[Measured, InProcess]:
    m = Measured()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        _, m.prompt_tokens = await stream_one(client, model, 4)  # warm-up
        assert m.prompt_tokens > 0, "the server reported no usage"
        await measure_itl(client, model, rounds, m)
        engine = InProcess(model_dir, m.prompt_tokens, device)
        await measure_ttft(client, url, model, engine, n, m)
    return m, engine


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def report(m: Measured, cmd: str, served: list[str], device: str) -> str:
    itl50, step50 = pct(m.itl_ms, 50), statistics.median(m.decode_ms)
    ttft50, pre50 = statistics.median(m.ttft_ms), statistics.median(m.prefill_ms)
    httpx50 = statistics.median(m.ttft_httpx_ms)
    rows = [
        ("ITL p50, 16 streams (served)", f"{itl50:.2f} ms"),
        ("ITL p90, 16 streams (served)", f"{pct(m.itl_ms, 90):.2f} ms"),
        ("decode step p50, batch 16 (in-process, forward + sample)", f"{step50:.2f} ms"),
        ("**ITL p50 / decode step p50** (target <= 1.3)", f"**{itl50 / step50:.2f}x**"),
        (
            f"TTFT p50, one at a time, {m.prompt_tokens}-token prompt, socket client",
            f"{ttft50:.2f} ms",
        ),
        ("TTFT p50, same, httpx AsyncClient (its own cost included)", f"{httpx50:.2f} ms"),
        ("prefill p50, same length (in-process, forward + sample, interleaved)", f"{pre50:.2f} ms"),
        ("**TTFT p50 - prefill p50** (target <= 5 ms)", f"**{ttft50 - pre50:.2f} ms**"),
        ("TTFT p50 (httpx) - prefill p50", f"{httpx50 - pre50:.2f} ms"),
    ]
    title = f"# Serving overhead: launched 1P+1D vs the engine in-process ({device.upper()})"
    lines = [title, "", f"Command: `{cmd}`", "", "| measurement | value |", "| --- | ---: |"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += [
        "",
        f"Samples: {len(m.itl_ms)} inter-token gaps, {len(m.ttft_ms)} TTFTs per client, "
        f"{len(m.decode_ms)} decode steps, {len(m.prefill_ms)} prefills. Served side: "
        f"`launch {' '.join(served)}`, /v1/completions "
        f"streaming, max_tokens {MAX_TOKENS} (ITL) or 1 (TTFT), ignore_eos, temperature 0.",
        "",
        *machine_block(),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = quick_parser(__doc__, "fewer requests, printed")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: both roles share GPU 0, as does the in-process engine",
    )
    parser.add_argument("--model", type=Path, help="checkpoint (default: the tiny model)")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = args.model or tiny.tiny_model_dir()
    rounds, ttfts = (1, 5) if args.quick else (3, 50)
    served = [
        *shlex.split("--prefill 1 --decode 1 --detokenizers 1 --device"),
        args.device,
        "--model",
        str(model),
    ]
    if args.device == "cuda":  # the two workers take half the GPU; the rest is ours
        served += shlex.split("--prefill-gpus 0 --decode-gpus 0 --gpu-memory-utilization 0.5")
    proc, url = launch(served)
    try:
        measured, engine = asyncio.run(measure_served(url, model, rounds, ttfts, args.device))
    finally:
        proc.terminate()
        proc.wait(30)
    measured.decode_ms = engine.decode_steps_ms()  # with the server gone, as ITL's baseline
    cmd = "python -m benchmarks.serving.serving_overhead " + " ".join(sys.argv[1:])
    text = report(measured, cmd.strip(), served, args.device)
    if not args.quick:  # a smoke run is no record
        out = RESULTS if args.device == "cpu" else RESULTS_CUDA
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
