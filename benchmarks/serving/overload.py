"""Overload: does ``/health`` keep answering while 500 streaming clients hammer the server?

Each run first probes an idle server (the baseline), then fires ``--clients`` streaming
``/v1/completions`` requests at once from one httpx client while a separate process probes
``GET /health`` every 50 ms over a fresh TCP connection (as a load balancer would). Beyond
the admission bound the server must answer 503 + Retry-After; every admitted stream must
finish; the frontend's RSS must stay bounded. The issue's target: /health p99 < 100 ms.

    python -m benchmarks.serving.overload --runs 5 --out benchmarks/results/overload

launches its own small server (``LAUNCH_ARGS``: an admission bound of 8 waiting
requests, so most of the storm is refused); ``--url`` measures a running server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.machine import machine_block
from benchmarks.harness.processes import process_tree, rss_bytes
from benchmarks.harness.servers import launch

logger = logging.getLogger(__name__)

LAUNCH_ARGS = tuple(
    shlex.split(
        "--prefill 1 --decode 1 --detokenizers 1 --device cpu --kv-cache-tokens 2048 --max-model-len 256 --max-waiting-requests 8 --max-num-seqs 8"
    )
)
CLIENTS = 500
MAX_TOKENS = 4
STORM_TIMEOUT_S = 90.0

# Runs in its own interpreter, so the storm's event loop cannot inflate what it sees:
# GET /health every 50 ms over a fresh raw socket (building an httpx client costs tens of
# ms), until a line arrives on stdin (at most 100 s); then prints one JSON line with the
# latencies (s) and status lines.
PROBE = """
import json, select, socket, sys, time
port = int(sys.argv[1])
ask = b"GET /health HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n"
out, codes, end = [], [], time.monotonic() + 100
print("ready", flush=True)
while time.monotonic() < end and not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(ask)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    out.append(time.monotonic() - t0)
    codes.append(reply.split(b"\\r\\n", 1)[0].decode())
    time.sleep(max(0.0, 0.05 - (time.monotonic() - t0)))
print(json.dumps({"latencies": out, "codes": codes}))
"""


class Probe:
    """The probe process; ``stop()`` returns (latencies in s, HTTP status lines)."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def stop(self) -> tuple[list[float], list[str]]:
        out = json.loads(self.proc.communicate("stop\n", timeout=30)[0])
        return out["latencies"], out["codes"]


async def _stream(client: httpx.AsyncClient, i: int) -> dict[str, object]:
    body = {
        "prompt": f"request {i}: count to ten",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            return {"status": r.status_code, "headers": dict(r.headers), "body": raw.decode()}
        finish, done = None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return {"status": 200, "finish": finish, "done": done}


async def storm(
    url: str, clients: int = CLIENTS, sustain_s: float = 0.0
) -> list[dict[str, object]]:
    """``clients`` streaming requests at once; one result dict per request.

    ``sustain_s`` > 0: each client asks again as soon as it has an answer (503 or a
    finished stream, ignoring Retry-After, as a hostile client would) until that long has
    passed.
    """
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    end = time.monotonic() + sustain_s

    async def client_loop(client: httpx.AsyncClient, i: int) -> list[dict[str, object]]:
        out = [await _stream(client, i)]
        while time.monotonic() < end:
            out.append(await _stream(client, i))
        return out

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        tasks = [client_loop(client, i) for i in range(clients)]
        per_client = await asyncio.wait_for(asyncio.gather(*tasks), STORM_TIMEOUT_S + sustain_s)
    return [r for results in per_client for r in results]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def frontend_pid(root: int) -> int:
    """The ``pdserve:frontend`` process under the launcher ``root``."""
    for pid in process_tree(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"pdserve:frontend"):
                return pid
        except OSError:
            continue
    raise RuntimeError(f"no pdserve:frontend under pid {root}")


@dataclass
class Run:
    idle_ms: list[float] = field(default_factory=list)  # /health with no load
    storm_ms: list[float] = field(default_factory=list)  # /health during the storm
    refused: int = 0  # 503 with Retry-After
    finished: int = 0  # 200, streamed to [DONE] with finish_reason "length"
    other: dict[str, int] = field(default_factory=dict)  # anything else, by status
    non_200_probes: int = 0
    storm_s: float = 0.0
    rss_before: int = 0
    rss_after: int = 0


def one_run(url: str, frontend: int | None, clients: int, sustain_s: float = 0.0) -> Run:
    port = int(url.rsplit(":", 1)[1])
    run = Run()
    probe = Probe(port)
    time.sleep(3.0)
    idle, codes = probe.stop()
    run.idle_ms = [1000 * x for x in idle]
    run.rss_before = rss_bytes(frontend) if frontend else 0
    probe = Probe(port)
    t0 = time.monotonic()
    results = asyncio.run(storm(url, clients, sustain_s))
    run.storm_s = time.monotonic() - t0
    lat, codes = probe.stop()
    run.storm_ms = [1000 * x for x in lat]
    run.non_200_probes = sum(c != "HTTP/1.1 200 OK" for c in codes)
    run.rss_after = rss_bytes(frontend) if frontend else 0
    for r in results:
        headers = r.get("headers")
        if r["status"] == 503 and isinstance(headers, dict) and "retry-after" in headers:
            run.refused += 1
        elif r["status"] == 200 and r.get("done") and r.get("finish") == "length":
            run.finished += 1
        else:
            run.other[str(r["status"])] = run.other.get(str(r["status"]), 0) + 1
    return run


def _row(i: int, r: Run) -> str:
    def ms(xs: list[float], q: float) -> str:
        return f"{percentile(xs, q):.0f}" if xs else "-"

    mib = 2**20
    return (
        f"| {i} | {r.refused} | {r.finished} | {sum(r.other.values())} | {r.storm_s:.1f} s "
        f"| {ms(r.idle_ms, 0.5)} / {ms(r.idle_ms, 0.99)} "
        f"| {len(r.storm_ms)} | {ms(r.storm_ms, 0.5)} | **{ms(r.storm_ms, 0.99)}** "
        f"| {max(r.storm_ms, default=0):.0f} | {r.non_200_probes} "
        f"| {r.rss_before / mib:.1f} → {r.rss_after / mib:.1f} |"
    )


def write_report(runs: list[Run], out: Path, command: str, clients: int, sustain_s: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command,
        "machine": describe_machine(),
        "clients": clients,
        "sustain_s": sustain_s,
        "runs": [asdict(r) for r in runs],
    }
    how = (
        f"each client re-asking as soon as it is answered (503s included) for {sustain_s:g} s"
        if sustain_s
        else "once each"
    )
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    p99s = [percentile(r.storm_ms, 0.99) for r in runs if r.storm_ms]
    lines = [
        f"# Overload: /health under {clients} concurrent streaming clients",
        "",
        f"Command: `{command}`",
        "",
        f"Server: `launch {' '.join(LAUNCH_ARGS)}` unless the command says `--url`. Each run: "
        "/health probed for 3 s on the idle server (baseline), then "
        f"{clients} `/v1/completions` streams (max_tokens {MAX_TOKENS}) at once from one "
        f"httpx.AsyncClient, {how}, while a separate process probes `GET /health` every 50 ms "
        "over a fresh TCP connection. Target: /health p99 < 100 ms.",
        "",
        "| run | 503 + Retry-After | 200, finished | other | storm | idle /health p50 / p99 ms "
        "| probes | storm /health p50 ms | p99 ms | max ms | non-200 probes "
        "| frontend RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(_row(i + 1, r) for i, r in enumerate(runs)),
        "",
        f"Median over runs of the storm p99: **{statistics.median(p99s):.0f} ms**; "
        f"worst {max(p99s):.0f} ms."
        if p99s
        else "",
        "",
        *machine_block(),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--clients", type=int, default=CLIENTS)
    p.add_argument(
        "--sustain",
        type=float,
        default=0.0,
        help="seconds each client keeps re-asking (0: one request each)",
    )
    p.add_argument("--url", help="measure this server instead of launching one")
    p.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    proc, url, frontend = None, args.url, None
    if url is None:
        proc, url = launch(list(LAUNCH_ARGS))
        frontend = frontend_pid(proc.pid)
    runs = []
    try:
        for i in range(args.runs):
            runs.append(one_run(url, frontend, args.clients, args.sustain))
            r = runs[-1]
            logger.info(
                "run %d: %d refused, %d finished, %s other; /health p50 %.0f p99 %.0f "
                "max %.0f ms (idle p99 %.0f ms)",
                i + 1,
                r.refused,
                r.finished,
                r.other,
                percentile(r.storm_ms, 0.5),
                percentile(r.storm_ms, 0.99),
                max(r.storm_ms),
                percentile(r.idle_ms, 0.99),
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.out is not None:
        argv_text = " ".join(argv if argv is not None else sys.argv[1:])
        command = f"python -m benchmarks.serving.overload {argv_text}"
        write_report(runs, args.out, command, args.clients, args.sustain)
    bad = any(r.other or r.non_200_probes for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
