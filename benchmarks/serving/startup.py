"""Time from ``launch`` to serving, the process tree's memory, and SIGTERM to exit.

    python -m benchmarks.serving.startup [--runs 3] [--out benchmarks/results/startup.md] \
        -- --prefill 2 --decode 2 --detokenizers 2

Everything after ``--`` goes to ``launch`` as is (no ``--model``: the embedded default,
converted and cached by a first run that is not timed). Per run: seconds until ``/health``
first answers 200 (every role has a ready worker; the URL is printed then), seconds until
every worker is ready, a greedy chat answer, the tree's RSS (each process's resident set
summed, so pages shared between workers count once per worker) beside the KV budget the
launcher logged, and seconds from SIGTERM until the launcher has exited.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness.machine import machine_block
from benchmarks.harness.processes import process_tree, rss_bytes
from benchmarks.harness.servers import free_port

_KV_LINE = re.compile(
    r"KV cache: ([\d.]+) GiB = \d+ tokens per pool x (\d+) pools; "
    r"weights ([\d.]+) GiB per replica"
)


@dataclass
class Run:
    health_200_s: float
    all_ready_s: float
    sigterm_exit_s: float
    exit_code: int
    rss_gib: float
    kv_gib_per_pool: float  # as the launcher logged it
    pools: int
    weights_gib: float
    answer: str


def one_run(launch_args: list[str]) -> Run:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "launcher.cli", "--port", str(port), *launch_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout or ()), daemon=True).start()
    first_200: float | None = None
    all_ready: float | None = None
    deadline = t0 + 600
    with httpx.Client(base_url=url, timeout=5) as c:
        while all_ready is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("not every worker ready after 600 s:\n" + "".join(log[-30:]))
            if proc.poll() is not None:
                raise RuntimeError("launch exited before serving:\n" + "".join(log[-30:]))
            try:
                r = c.get("/health")
            except httpx.TransportError:
                r = None
            now = time.monotonic() - t0
            if r is not None and r.status_code == 200:
                first_200 = first_200 if first_200 is not None else now
                if r.json()["status"] == "ok":
                    all_ready = now
            time.sleep(0.05)
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "max_tokens": 20,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
        answer = c.post("/v1/chat/completions", json=body, timeout=120).json()
    rss = sum(rss_bytes(p) for p in process_tree(proc.pid))
    kv = next((m for m in map(_KV_LINE.search, log) if m), None)
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert first_200 is not None
    return Run(
        first_200,
        all_ready,
        time.monotonic() - t1,
        code,
        rss / 2**30,
        float(kv.group(1)) if kv else 0.0,
        int(kv.group(2)) if kv else 0,
        float(kv.group(3)) if kv else 0.0,
        answer["choices"][0]["message"]["content"] if "choices" in answer else str(answer),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("launch_args", nargs="*")
    a = p.parse_args()
    from bundled_models.default_model import resolve_model

    # Convert (once) and cache whatever --model names, so no run times a conversion.
    given = (
        a.launch_args[a.launch_args.index("--model") + 1] if "--model" in a.launch_args else None
    )
    resolve_model(Path(given) if given else None)
    runs = [one_run(a.launch_args) for _ in range(a.runs)]
    cmd = "python -m benchmarks.serving.startup --runs {} -- {}".format(
        a.runs, " ".join(a.launch_args)
    )
    lines = [
        "# Startup: launch to serving",
        "",
        f"Command: `{cmd}`",
        "",
        *machine_block(),
        "| run | /health 200 s | every worker ready s | tree RSS GiB | KV budget GiB "
        "(pools x per pool) | weights GiB x replicas | SIGTERM to exit s | answer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(runs, 1):
        kv = f"{r.pools * r.kv_gib_per_pool:.2f} ({r.pools} x {r.kv_gib_per_pool})"
        lines.append(
            f"| {i} | {r.health_200_s:.1f} | {r.all_ready_s:.1f} | {r.rss_gib:.2f} | "
            f"{kv} | {r.weights_gib} x {r.pools} | "
            f"{r.sigterm_exit_s:.1f} (exit {r.exit_code}) | {r.answer!r} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
