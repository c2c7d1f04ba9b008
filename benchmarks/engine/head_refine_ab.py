"""The LM head's near logits refined by one op against by torch's ops, in decode steps.

    python -m benchmarks.engine.head_refine_ab [--rows 1,5] [--context 300] [--rounds 16]
        [--threads 2] [--out FILE]

The engine is built as ``launch`` serves on CPU (the embedded model: packed layers, the
int8 head). ``RefinedHead`` recomputes each row's leading logits in float32: with
``refine_near_logits`` (``engine/kernels/cpu/near_logits.cpp``, the default where pdserve's
kernels run) or with the torch ops it replaced (``refine_op`` set to None). Each round runs
a fresh sequence of ``--context`` tokens for 64 steps, the two paths taking turns step by
step; one row is a decode step, k + 1 rows a verification of k drafts. Median step time of
each path and their ratio. Writes
``benchmarks/results/head_refine.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.engine.step_roofline import STEPS_PER_SEQUENCE, fresh, one_step, served_runner
from benchmarks.harness.machine import load_average, machine_block
from engine.runner import ModelRunner
from engine.weights.refined_head import RefinedHead

RESULTS = Path(__file__).parents[1] / "results" / "head_refine.md"


def steps(
    runner: ModelRunner,
    head: RefinedHead,
    op: Callable[..., torch.Tensor],
    context: int,
    rows: int,
    rid: int,
) -> dict[str, list[float]]:
    """One sequence's steps, the paths taking turns step by step (so that a machine whose
    speed drifts over seconds hits both alike)."""
    seq = fresh(runner, context, rid)
    out: dict[str, list[float]] = {"torch": [], "op": []}
    for i in range(STEPS_PER_SEQUENCE):
        name = ("op", "torch")[(i + rid) % 2]
        head.refine_op = op if name == "op" else None
        out[name].append(one_step(runner, seq, rows))
    head.refine_op = op
    runner.kv.free_blocks(seq)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.head_refine_ab", description=__doc__
    )
    p.add_argument("--rows", default="1,5")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runner = served_runner(None, 4 * (args.context + STEPS_PER_SEQUENCE + 64))
    head = next(m for m in runner.model.modules() if isinstance(m, RefinedHead))
    op = head.refine_op
    if op is None:
        raise SystemExit("refine_near_logits does not run here (pdserve's CPU kernels, int8 head)")
    lines = [
        "| rows | torch ops ms | one op ms | op / torch |",
        "|---:|---:|---:|---:|",
    ]
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {"torch": [], "op": []}
        for r in range(args.rounds):
            for name, got in steps(runner, head, op, args.context, rows, r).items():
                times[name] += got
        a, b = statistics.median(times["torch"]), statistics.median(times["op"])
        lines.append(f"| {rows} | {1e3 * a:.3f} | {1e3 * b:.3f} | {b / a:.3f}x |")
        print(lines[-1], flush=True)
    cmd = " ".join(["python -m benchmarks.engine.head_refine_ab", *sys.argv[1:]])
    head_lines = [
        "# The LM head's near logits: one op against torch's ops",
        "",
        f"Command: `{cmd}`. Context {args.context} tokens, {args.threads} threads, "
        f"{args.rounds} rounds of {STEPS_PER_SEQUENCE} steps, the paths taking turns step by "
        f"step; median step time. Load average at the end: {load_average()}.",
        "",
    ]
    args.out.write_text("\n".join([*head_lines, *lines, "", *machine_block()]) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
