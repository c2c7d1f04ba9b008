"""Frontend CPU per request and the request-rate ceiling, with 1 and with 2 frontends.

    python -m benchmarks.serving.api_workers [--api-workers 1 2] [--workloads short long] \
        [--seconds 20] [--clients 64] [--client-procs 2] [--out benchmarks/results/api_workers.md]

For each ``--api-workers`` value and each workload it launches its own server (the tiny
random Qwen2 model, 1 prefill, 1 decode, 1 detokenizer shard unless ``-- <launch args>``
says otherwise), then drives it closed-loop: ``--clients`` keep-alive connections spread
over ``--client-procs`` processes, each sending its next request as soon as the last one
is answered. Every request asks for one output token, so the engine does little and the
frontends' own work (HTTP, JSON, tokenization, chat template, routing, relaying) is what
runs out first. Workloads:

    short   /v1/completions, a one-line prompt
    long    /v1/chat/completions, one user message of about 2,000 tokens through the
            chat template (the tail differs per request, so nothing is cached on the way)

Reported per run: requests/s over the measured window (after ``--warmup``), frontend CPU
per request (user + system time of every ``pdserve:frontend-*`` process over the window,
divided by the requests answered in it), the busiest frontend's share of one core, and
how the answers spread over the frontends (the ``x-pdserve-frontend`` header). The
issue's target, where the frontend is the bottleneck: 2 frontends sustain >= 1.6x the
request rate of 1, and CPU per request does not grow. The load generator is a few lines
of raw HTTP/1.1 (no client library): on a small machine it shares the cores with the
server, and must cost far less than what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from benchmarks.harness.machine import machine_block
from benchmarks.harness.processes import cpu_seconds, process_tree
from benchmarks.harness.servers import launch
from benchmarks.harness.words import PLAIN_WORDS

LAUNCH_ARGS = tuple(
    shlex.split(
        "--prefill 1 --decode 1 --detokenizers 1 --device cpu --kv-cache-tokens 65536 --max-model-len 4096"
    )
)
LONG_PROMPT_TOKENS = 2000
WORKLOADS = ("short", "long")
_WORDS = (
    *PLAIN_WORDS,
    "seven",
    "owls",
    "count",
    "stars",
)


@dataclass
class Window:
    """What one client process saw inside the measured window."""

    done: int = 0
    errors: int = 0
    by_frontend: dict[str, int] = field(default_factory=dict)


@dataclass
class Run:
    api_workers: int
    workload: str
    seconds: float
    done: int
    errors: int
    frontend_cpu_s: float
    busiest_core_share: float  # the busiest frontend's CPU seconds per wall second
    by_frontend: dict[str, int]

    @property
    def rate(self) -> float:
        return self.done / self.seconds

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.frontend_cpu_s / max(1, self.done)


# ---- the load generator (runs in client processes) -----------------------------------


def _request_bytes(host: str, path: str, body: dict[str, object]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, str | None]:
    """(status, x-pdserve-frontend) of one non-streamed response; the body is skipped."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers.get("x-pdserve-frontend")


async def _connection(
    url: str, requests: list[bytes], start: float, end: float, window: Window
) -> None:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    i = 0
    try:
        while (now := time.monotonic()) < end:
            writer.write(requests[i % len(requests)])
            i += 1
            status, frontend = await _read_response(reader)
            if now < start:
                continue  # warming up
            if status == 200:
                window.done += 1
                key = frontend or "?"
                window.by_frontend[key] = window.by_frontend.get(key, 0) + 1
            else:
                window.errors += 1
    finally:
        writer.close()


def client_process(
    url: str, requests: list[bytes], clients: int, start: float, end: float
) -> Window:
    """``clients`` closed-loop connections until ``end`` (monotonic, host-wide); counts
    what was answered from ``start`` on."""
    window = Window()

    async def main() -> None:
        await asyncio.gather(
            *(
                _connection(url, requests[k::clients] or requests, start, end, window)
                for k in range(clients)
            )
        )

    asyncio.run(main())
    return window


# ---- the server side ----------------------------------------------------------------


def frontend_pids(root: int) -> list[int]:
    pids = []
    for pid in process_tree(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"pdserve:frontend"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def workload_requests(workload: str, url: str, model: str, count: int = 256) -> list[bytes]:
    host = urlsplit(url).netloc
    if workload == "short":
        body = {
            "model": model,
            "prompt": "Hello, how are you today?",
            "max_tokens": 1,
            "temperature": 0,
        }
        return [_request_bytes(host, "/v1/completions", body)]
    # About LONG_PROMPT_TOKENS tokens: the tokenizer's count of the filler, checked here.
    filler = long_text(url)
    out = []
    for i in range(count):
        message = {"role": "user", "content": f"{filler} Request {i}: summarise."}
        body = {"model": model, "messages": [message], "max_tokens": 1, "temperature": 0}
        out.append(_request_bytes(host, "/v1/chat/completions", body))
    return out


def long_text(url: str, tokens: int = LONG_PROMPT_TOKENS) -> str:
    """Plain English-like text of about ``tokens`` tokens, counted by the server's own
    ``/tokenize`` (so it holds for whatever model it serves)."""
    words = _WORDS
    text = " ".join(words[i % len(words)] for i in range(tokens))
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/tokenize", json={"prompt": text})
        r.raise_for_status()
        have = int(r.json()["count"])
    keep = max(1, round(tokens * tokens / max(1, have)))  # words scale ~linearly to tokens
    return " ".join(words[i % len(words)] for i in range(keep))


def one_run(
    api_workers: int, workload: str, args: argparse.Namespace, launch_args: list[str]
) -> Run:
    proc, url = launch([*launch_args, "--api-workers", str(api_workers)])
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
        requests = workload_requests(workload, url, model)
        pids = frontend_pids(proc.pid)
        assert len(pids) == api_workers, f"found frontends {pids}"
        start = time.monotonic() + args.warmup
        end = start + args.seconds
        per_proc = max(1, args.clients // args.client_procs)
        with ProcessPoolExecutor(args.client_procs, mp_context=get_context("spawn")) as pool:
            futures = [
                pool.submit(client_process, url, requests, per_proc, start, end)
                for _ in range(args.client_procs)
            ]
            time.sleep(max(0.0, start - time.monotonic()))
            before = {pid: cpu_seconds(pid) for pid in pids}
            time.sleep(max(0.0, end - time.monotonic()))
            after = {pid: cpu_seconds(pid) for pid in pids}
            windows = [f.result() for f in futures]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    used = {pid: after[pid] - before[pid] for pid in pids}
    by_frontend: dict[str, int] = {}
    for w in windows:
        for key, n in w.by_frontend.items():
            by_frontend[key] = by_frontend.get(key, 0) + n
    return Run(
        api_workers,
        workload,
        args.seconds,
        sum(w.done for w in windows),
        sum(w.errors for w in windows),
        sum(used.values()),
        max(used.values()) / args.seconds,
        dict(sorted(by_frontend.items())),
    )


# ---- report -------------------------------------------------------------------------


def table(runs: list[Run]) -> list[str]:
    lines = [
        "| workload | api workers | requests/s | vs 1 worker | frontend CPU ms/request "
        "| busiest frontend, cores | answered by frontend | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {r.workload: r.rate for r in runs if r.api_workers == 1}
    for r in runs:
        ratio = f"{r.rate / base[r.workload]:.2f}x" if base.get(r.workload) else "-"
        spread = ", ".join(f"{k}: {v}" for k, v in r.by_frontend.items())
        lines.append(
            f"| {r.workload} | {r.api_workers} | {r.rate:.0f} | {ratio} | "
            f"{r.cpu_ms_per_request:.2f} | {r.busiest_core_share:.2f} | {spread} | "
            f"{r.errors} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api-workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--clients", type=int, default=64, help="concurrent connections in all")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the report here (markdown)")
    args = p.parse_args(argv)
    launch_args = extra or list(LAUNCH_ARGS)
    runs = []
    for workload in args.workloads:
        for n in args.api_workers:
            run = one_run(n, workload, args, launch_args)
            print(
                f"{workload}, --api-workers {n}: {run.rate:.0f} req/s, "
                f"{run.cpu_ms_per_request:.2f} ms frontend CPU/request, {run.by_frontend}, "
                f"{run.errors} errors",
                flush=True,
            )
            runs.append(run)
    report = table(runs)
    print("\n".join(report))
    if args.out is not None:
        command = "python -m benchmarks.serving.api_workers " + " ".join(sys.argv[1:])
        args.out.write_text(
            "\n".join(
                [
                    "# Several frontends: request rate and frontend CPU per request",
                    "",
                    f"`{command}`",
                    "",
                    *report,
                    "",
                    *machine_block(),
                ]
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
