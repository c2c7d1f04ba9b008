"""Where a loaded server's CPU time goes: each process of a launched tree, and the client.

    python -m benchmarks.serving.cpu_split [--flags "--colocated 1"] [--concurrency 32] \
        [--prompts 64] [--input-len 256] [--output-len 64] [--perf-s 12] [--out FILE]

Starts ``launch`` on the default model, warms it with one round of ``--concurrency``
requests, then drives ``--prompts`` random prompts (``ignore_eos``, greedy) at that
concurrency and reads each process's user + system CPU seconds from ``/proc`` before and
after, and the client's from ``getrusage``. On a host with as many cores as the engine has
threads, the engine's share against the cores' total says how much of the machine the
serving stack around it (frontend, detokenizer, client) takes. With ``--perf-s``, ``perf
record`` samples the engine worker for that many seconds of the load and the page lists
where its time went, by shared object and by symbol (``perf`` must be on the PATH).
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.harness.machine import load_average
from benchmarks.harness.processes import cpu_seconds
from benchmarks.harness.servers import launch
from benchmarks.serving.launch_ab import write_page
from benchmarks.serving.load_ab import load_flags, run_client
from bundled_models.default_model import DEFAULT_MODEL_NAME, default_model_dir

ENGINE_TITLES = ("pdserve:colocated", "pdserve:prefill", "pdserve:decode")


def process_tree(root: int, ps_lines: list[str]) -> dict[int, str]:
    """``root`` and its descendants, each with its command line, from ``ps -e -o
    pid=,ppid=,args=`` output."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for line in ps_lines:
        parts = line.split(None, 2)
        if len(parts) < 2:
            continue
        pid, ppid = int(parts[0]), int(parts[1])
        children.setdefault(ppid, []).append(pid)
        names[pid] = parts[2] if len(parts) > 2 else ""
    out: dict[int, str] = {}
    stack = [root]
    while stack:
        pid = stack.pop()
        out[pid] = names.get(pid, "")
        stack.extend(children.get(pid, ()))
    return out


def _ps() -> list[str]:
    return subprocess.run(
        ["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True, check=True
    ).stdout.splitlines()


def _perf_lines(data: Path, sort: str, top: int) -> list[str]:
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "-g", "none", "--sort", sort],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    rows = [r.strip() for r in report.splitlines() if r.strip() and not r.startswith("#")]
    return [f"    {r[:160]}" for r in rows[:top]]


def _start_perf(data: Path, pid: int, seconds: float) -> subprocess.Popen[bytes]:
    record = ["perf", "record", "-F", "499", "-o", str(data), "-p", str(pid)]
    return subprocess.Popen(
        [*record, "--", "sleep", f"{seconds:g}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _profile(data: Path, seconds: float) -> list[str]:
    """The page's lines on a finished ``perf record`` of the engine."""
    head = f"perf, the engine worker ({seconds:g} s of the load), by object:"
    by_object, by_symbol = _perf_lines(data, "dso", 8), _perf_lines(data, "dso,sym", 15)
    return ["", head, *by_object, "", "by symbol:", *by_symbol]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.cpu_split", description=__doc__)
    p.add_argument("--flags", default="--colocated 1", help="launch arguments")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--perf-s", type=float, default=0.0, help="perf-sample the engine this long")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if args.perf_s and shutil.which("perf") is None:
        p.error("--perf-s needs perf on the PATH")
    model = str(default_model_dir())
    start_load = load_average()
    warm = argparse.Namespace(**{**vars(args), "prompts": args.concurrency, "range_ratio": 0.0})
    load = load_flags(argparse.Namespace(**{**vars(args), "range_ratio": 0.0}))
    proc, url = launch(
        ["--model", model, "--served-model-name", DEFAULT_MODEL_NAME, *shlex.split(args.flags)]
    )
    try:
        run_client(url, model, 99, load_flags(warm))
        procs = process_tree(proc.pid, _ps())
        engine = next((pid for pid, n in procs.items() if n.startswith(ENGINE_TITLES)), None)
        before = {pid: cpu_seconds(pid) for pid in procs}
        client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "perf.data"
            perf = _start_perf(data, engine, args.perf_s) if args.perf_s and engine else None
            t0 = time.monotonic()
            result = run_client(url, model, 1, load)
            wall = time.monotonic() - t0
            after = {pid: cpu_seconds(pid) for pid in procs}
            client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            profile: list[str] = []
            if perf is not None:
                perf.wait(timeout=args.perf_s + 60)
                profile = _profile(data, args.perf_s)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    client = sum(getattr(client1, f) - getattr(client0, f) for f in ("ru_utime", "ru_stime"))
    lines = [
        f"Output {result['output_throughput']:.1f} tok/s, TTFT p50 {result['p50_ttft_ms']:.0f} ms,"
        f" ITL p50 {result['p50_itl_ms']:.1f} ms; the client ran {wall:.1f} s (its start"
        " included).",
        "",
        "| process | CPU s | cores over the client's run |",
        "|---|---:|---:|",
    ]
    spent = {pid: after[pid] - before[pid] for pid in procs}
    for pid, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
        if secs >= 0.05:
            name = procs[pid].split()[0] if procs[pid] else str(pid)
            lines.append(f"| {name} | {secs:.2f} | {secs / wall:.2f} |")
    lines.append(f"| the client (`benchmarks.serving`) | {client:.2f} | {client / wall:.2f} |")
    total = sum(spent.values()) + client
    lines.append(f"| all | {total:.2f} | {total / wall:.2f} of {os.cpu_count()} |")
    write_page(
        "CPU time by process under load",
        f"Command: `python -m benchmarks.serving.cpu_split --flags {shlex.quote(args.flags)} "
        f"--concurrency {args.concurrency} --prompts {args.prompts} --input-len "
        f"{args.input_len} --output-len {args.output_len}"
        + (f" --perf-s {args.perf_s:g}" if args.perf_s else "")
        + f"`; the default model. Load average at the start: {start_load}; at the end: "
        f"{load_average()}.",
        lines + profile,
        args.out,
    )


if __name__ == "__main__":
    main()
