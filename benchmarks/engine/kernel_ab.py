"""Two builds of pdserve's CPU kernel library on the attention of decode steps and
speculative verifications, alternating processes in the same minutes.

    python -m benchmarks.engine.kernel_ab --a OLD.so --b engine/kernels/cpu/_kernels*.so \
        [--contexts 300,1000,2500] [--rows 1,5] [--threads 1,2] [--rounds 4] [--out PATH]

A build is a ``_kernels*.so`` (``make setup`` builds this checkout's; copy it aside before
rebuilding to keep the "before"). Each round runs one process per build, a then b, each
timing every point (median of 15 calls after 3 warm ones); a point's figure is the median
over rounds. A point is one decode step's attention over SmolLM2-135M's 30 layers (9
query and 3 KV heads of 64, bfloat16 pool, scattered blocks): ``rows`` 1 is a decode row,
``rows`` k + 1 a verification of k drafts, rows of one sequence
(``attention_ops.verify_attention_ops``). The machine's memory bandwidth moves between
hours here; alternating rounds is what makes the ratio trustworthy.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "kernel_ab.md"


def _child(lib: str, contexts: list[int], rows: list[int], threads: int) -> None:
    """Time every point with the library at ``lib``; print {"ctx/rows": ms} as JSON."""
    import torch

    import engine.kernels.cpu.ops as ops
    from engine.kernels import vllm_cpu

    torch.set_num_threads(threads)
    ops.library_path = lambda: Path(lib)  # this process loads the named build, not the tree's
    vllm_cpu.load()
    from benchmarks.engine.attention_ops import verify_attention_ops

    out: dict[str, float] = {}
    for ctx in contexts:
        for r in rows:
            step = verify_attention_ops(r - 1, ctx)["together"]
            for _ in range(3):
                step()
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out[f"{ctx}/{r}"] = statistics.median(times) * 1e3
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.kernel_ab", description=__doc__)
    p.add_argument("--a", help="the baseline build (a _kernels*.so)")
    p.add_argument("--b", help="the build measured against it")
    p.add_argument("--contexts", default="300,1000,2500")
    p.add_argument("--rows", default="1,5", help="1: a decode row; k + 1: a verification")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--note", action="append", default=[], help="a line for the page (repeatable)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        _child(args.child, contexts, rows, int(args.threads))
        return
    from benchmarks.harness.machine import machine_block, portable

    for lib in (args.a, args.b):
        if lib is None:
            p.error("--a and --b are required")
        if not Path(lib).is_file():
            raise SystemExit(f"no such build: {lib}")
    table: dict[tuple[int, str, str], list[float]] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        for _ in range(args.rounds):
            for side, lib in (("a", args.a), ("b", args.b)):
                cmd = [sys.executable, "-m", "benchmarks.engine.kernel_ab", "--child", lib,
                       "--contexts", args.contexts, "--rows", args.rows,
                       "--threads", str(threads)]  # fmt: skip
                got = json.loads(
                    subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                )
                for point, ms in got.items():
                    table.setdefault((threads, point, side), []).append(ms)
                print(threads, side, got, flush=True)
    command = portable(shlex.join(["python", "-m", "benchmarks.engine.kernel_ab", *sys.argv[1:]]))
    lines = [
        "# Two builds of the CPU kernel library: a decode step's and a verification's attention",
        "",
        f"Command: `{command}`. a: `{portable(args.a)}`, b: `{portable(args.b)}`. Milliseconds "
        f"for 30 layers, the median over {args.rounds} alternating rounds (each a median of 15 "
        "calls).",
        "",
        *(f"- {note}" for note in args.note),
        "",
        "| threads | context | rows | a ms | b ms | a / b |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for threads in (int(t) for t in args.threads.split(",")):
        for ctx in contexts:
            for r in rows:
                a = statistics.median(table[(threads, f"{ctx}/{r}", "a")])
                b = statistics.median(table[(threads, f"{ctx}/{r}", "b")])
                lines.append(f"| {threads} | {ctx} | {r} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    lines += ["", *machine_block()]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
