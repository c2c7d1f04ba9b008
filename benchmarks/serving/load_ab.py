"""Two ``launch`` settings under the same load, one server at a time, alternating rounds.

    python -m benchmarks.serving.load_ab --a "--colocated 1 --no-mixed-batches" \
        --b "--colocated 1" [--rate 5] [--concurrency N] [--prompts 48] \
        [--input-len 256] [--range-ratio 0.5] [--output-len 64] [--rounds 2] [--out FILE]

Each round starts server A on the default model, drives it with ``python -m
benchmarks.serving`` (random prompts, ``ignore_eos``; Poisson arrivals at ``--rate``
req/s, or ``--concurrency`` requests in flight), stops it, then does the same for B (the
order swapped every round, so a drifting machine hits both alike). Unlike
``benchmarks.serving.launch_ab`` (single streams, both servers up at once), a loaded server needs
every core, so only one runs at a time. Round r draws its prompts and arrivals with seed
r, the same for both. Reported per server and round: output tokens/s, TTFT p50, TPOT p50,
ITL p50 and p99; the CPU time a generated token cost each kind of process (the engine
workers, the detokenizer shards, the frontends: /proc, around the client's run); and B / A
per round, its median and range over the rounds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import load_average
from benchmarks.harness.processes import cpu_seconds, titled_tree
from benchmarks.harness.servers import launch
from benchmarks.serving.launch_ab import add_server_flags, write_page
from bundled_models.default_model import DEFAULT_MODEL_NAME, default_model_dir

METRICS = {  # result JSON key -> column
    "output_throughput": "out tok/s",
    "p50_ttft_ms": "TTFT p50 ms",
    "p50_tpot_ms": "TPOT p50 ms",
    "p50_itl_ms": "ITL p50 ms",
    "p99_itl_ms": "ITL p99 ms",
    "engine_cpu_us": "engine CPU us/tok",
    "detok_cpu_us": "detok CPU us/tok",
    "frontend_cpu_us": "frontend CPU us/tok",
}
ENGINE_ROLES = ("colocated", "prefill", "decode")


def load_flags(args: argparse.Namespace) -> list[str]:
    """The client's load arguments from ``args`` (``concurrency`` or ``rate``, ``prompts``,
    ``input_len``, ``range_ratio``, ``output_len``)."""
    if args.concurrency:
        load = ["--max-concurrency", str(args.concurrency)]
    else:
        load = ["--request-rate", str(args.rate)]
    return [
        *load,
        "--num-prompts",
        str(args.prompts),
        "--random-input-len",
        str(args.input_len),
        "--random-range-ratio",
        str(args.range_ratio),
        "--random-output-len",
        str(args.output_len),
    ]


def run_client(url: str, model: str, seed: int, load: list[str]) -> dict[str, Any]:
    """``python -m benchmarks.serving`` against ``url`` with the random dataset, ``load``'s
    arguments on top: its result JSON. ``RuntimeError`` naming the client's own error if it
    fails, or how many requests did."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.serving",
            *("--base-url", url, "--model", DEFAULT_MODEL_NAME, "--tokenizer", model),
            *("--dataset", "random", "--ignore-eos", "--seed", str(seed)),
            *("--metric-percentiles", "50,99", "--disable-tqdm", "--result-file", str(result)),
            *load,
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if run.returncode != 0:
            raise RuntimeError(f"the client failed: {run.stderr[-2000:]}")
        data: dict[str, Any] = json.loads(result.read_text())
    if data.get("failed"):
        raise RuntimeError(f"{data['failed']} requests failed")
    return data


def _one(
    flags: str, load: list[str], model: str, seed: int, tree: Path | None = None
) -> dict[str, float]:
    """Serve ``flags`` (from checkout ``tree``, if given), run the load against it, stop
    it: the result's metrics."""
    proc, url = launch(
        ["--model", model, "--served-model-name", DEFAULT_MODEL_NAME, *shlex.split(flags)], tree
    )
    try:
        before = _role_cpu(proc.pid)
        data = run_client(url, model, seed, load)
        spent = {role: cpu - before.get(role, 0.0) for role, cpu in _role_cpu(proc.pid).items()}
    except RuntimeError as e:
        raise RuntimeError(f"{flags}: {e}") from e
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    tokens = max(1, int(data["total_output_tokens"]))
    for kind, roles in (
        ("engine", ENGINE_ROLES),
        ("detok", ("detok",)),
        ("frontend", ("frontend",)),
    ):
        data[f"{kind}_cpu_us"] = 1e6 * sum(spent.get(r, 0.0) for r in roles) / tokens
    return {key: float(data[key]) for key in METRICS}


def _role_cpu(launcher: int) -> dict[str, float]:
    """CPU seconds so far of the server's processes by role (``pdserve:detok-1`` counts
    for ``detok``), each role's processes summed."""
    out: dict[str, float] = {}
    for title, pid in titled_tree(launcher).items():
        if title.startswith("pdserve:"):
            role = title.removeprefix("pdserve:").rsplit("-", 1)[0]
            out[role] = out.get(role, 0.0) + cpu_seconds(pid)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.load_ab", description=__doc__)
    add_server_flags(p)
    p.add_argument("--rate", type=float, default=5.0, help="req/s, Poisson arrivals")
    p.add_argument("--concurrency", type=int, default=0, help="instead of --rate: in flight")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths +- this share")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = str(default_model_dir())
    load = load_flags(args)
    start_load = load_average()
    got: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    flags = {"A": args.a, "B": args.b}
    trees = {"A": args.a_tree, "B": args.b_tree}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            got[name].append(_one(flags[name], load, model, seed=r, tree=trees[name]))
            print(name, r, got[name][-1], flush=True)
    head = "| server | round | " + " | ".join(METRICS.values()) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(METRICS)]
    for name in ("A", "B"):
        for r, m in enumerate(got[name]):
            cells = " | ".join(f"{m[k]:.1f}" for k in METRICS)
            lines.append(f"| {name} `{flags[name]}` | {r + 1} | {cells} |")
    # Per round (both servers saw the same arrivals and lengths), then over the rounds.
    each = {k: [b[k] / a[k] for a, b in zip(got["A"], got["B"], strict=True)] for k in METRICS}
    ratios = ", ".join(
        f"{col} {statistics.median(each[k]):.2f}x ({min(each[k]):.2f}-{max(each[k]):.2f})"
        for k, col in METRICS.items()
    )
    lines += ["", f"B / A, round by round: median (min-max) over the rounds: {ratios}."]
    how = f"--concurrency {args.concurrency}" if args.concurrency else f"--rate {args.rate:g}"
    write_page(
        "Two launch settings under the same load",
        f"Command: `python -m benchmarks.serving.load_ab --a {shlex.quote(args.a)} --b "
        f"{shlex.quote(args.b)} {how} --prompts {args.prompts} --input-len {args.input_len} "
        f"--range-ratio {args.range_ratio:g} --output-len {args.output_len} --rounds "
        f"{args.rounds}"
        + "".join(f" --{k.lower()}-tree <{k}'s checkout>" for k, t in trees.items() if t)
        + "`; the default model, random prompts, greedy, `ignore_eos`. Load "
        f"average at the start: {start_load}; at the end: {load_average()}.",
        lines,
        args.out,
    )


if __name__ == "__main__":
    main()
