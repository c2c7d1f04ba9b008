"""Decode attention with its context prefetched into L1 against into L2, in one process.

    python -m benchmarks.engine.kv_prefetch_ab [--rows 1,8] [--context 300,2048]
        [--rounds 30] [--steps 240] [--threads 2] [--pool-blocks 2048] [--out FILE]

``decode_attention`` (``engine/kernels/cpu/decode_attention.cpp``) prefetches each row's
context two blocks ahead, into L1 or L2 as the CPU's family decides; its ``prefetch``
argument sets one or the other. Two measurements, each taking turns between the two so
that a machine whose speed drifts hits both alike:

* **attention alone**: the default model's 30 layers of decode attention (9 heads over 3
  KV heads of 64, bfloat16 blocks of 16 tokens, block tables drawn at random from a pool
  larger than the L3) over ``--rows`` sequences of ``--context`` tokens, the caches
  flushed before each round (a step reads its weights between two reads of a layer's
  context), the prefetch alternating round by round;
* **a decode step**: the embedded model served as ``launch`` does on CPU, its layers one by
  one from Python (so that the step's attention calls can be given the argument), the
  prefetch alternating step by step; the ``--rows`` sequences start at ``--context``
  tokens and grow by one a step.

Medians of each side and of the paired ratios (L1 / L2 time). Writes
``benchmarks/results/kv_prefetch.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.engine.step_roofline import fresh, served_runner
from benchmarks.harness.machine import load_average, machine_block
from engine.kernels.cpu.ops import decode_attention_op
from engine.model.fused_cpu import FusedCpuBackend

RESULTS = Path(__file__).parents[1] / "results" / "kv_prefetch.md"
LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16  # SmolLM2-135M's
FLUSH_BYTES = 128 << 20  # more than the L3s seen here (32 MB)
SIDES = {"L2": 0, "L1": 1}


def paired(times: dict[str, list[float]]) -> str:
    """``| L2 ms | L1 ms | L1 / L2 (quartiles) |`` cells: medians, and the paired ratios'."""
    ratios = sorted(b / a for a, b in zip(times["L2"], times["L1"], strict=False))
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    a, b = statistics.median(times["L2"]), statistics.median(times["L1"])
    return f"{1e3 * a:.3f} | {1e3 * b:.3f} | {statistics.median(ratios):.3f}x ({q1:.3f}-{q3:.3f})"


def attention_alone(
    op: Callable[..., torch.Tensor], rows: int, context: int, rounds: int, pool_blocks: int
) -> tuple[dict[str, list[float]], float]:
    """Seconds of the 30 layers' attention per side, per round; and the bytes of context.
    The rows' blocks are drawn from a pool of at least ``pool_blocks``."""
    per_row = -(-context // BLOCK)
    blocks = max(2 * rows * per_row, pool_blocks)
    gen = torch.Generator().manual_seed(rows * context)
    pool = torch.randn(
        blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.bfloat16
    )
    chunk = BLOCK * KV_HEADS * HEAD_DIM
    # One layer's K (V) chunk of every block: the fused backend's views (``_layer_caches``).
    shape = (blocks, KV_HEADS, BLOCK, HEAD_DIM)
    strides = (LAYERS * 2 * chunk, BLOCK * HEAD_DIM, HEAD_DIM, 1)
    views = [
        (
            pool.as_strided(shape, strides, 2 * layer * chunk),
            pool.as_strided(shape, strides, (2 * layer + 1) * chunk),
        )
        for layer in range(LAYERS)
    ]
    tables = torch.randperm(blocks, generator=gen)[: rows * per_row].to(torch.int32)
    tables = tables.view(rows, per_row)
    lens = torch.full((rows,), context, dtype=torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    flush = torch.ones(FLUSH_BYTES // 4)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(2 * rounds):
        side = list(SIDES)[r % 2]
        flush.sum()
        t0 = time.perf_counter()
        for key, value in views:
            op(q, key, value, tables, lens, HEAD_DIM**-0.5, None, SIDES[side])
        times[side].append(time.perf_counter() - t0)
    return times, float(LAYERS * rows * context * KV_HEADS * HEAD_DIM * 2 * 2)


def decode_steps(rows: int, context: int, steps: int) -> dict[str, list[float]]:
    """Seconds of each decode step per side (the embedded model, layers from Python)."""
    runner = served_runner(None, rows * (context + 2 * steps + 64) + 1024)
    backend = runner.backend
    assert isinstance(backend, FusedCpuBackend)
    op = backend._decode_attention
    assert op is not None
    backend.decode_layers_op = None  # its layers' attention calls take the argument
    seqs = [fresh(runner, context, i) for i in range(rows)]
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(2 * steps):
        side = list(SIDES)[i % 2]
        backend._decode_attention = functools.partial(op, prefetch=SIDES[side])
        t0 = time.perf_counter()
        runner.decode(seqs)
        times[side].append(time.perf_counter() - t0)
        for seq in seqs:
            seq.output_ids.append(11)
    backend._decode_attention = op
    return times


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.kv_prefetch_ab", description=__doc__
    )
    p.add_argument("--rows", default="1,8")
    p.add_argument("--context", default="300,2048")
    p.add_argument("--rounds", type=int, default=30, help="attention alone, per side")
    p.add_argument("--steps", type=int, default=240, help="decode steps, per side (0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pool-blocks", type=int, default=2048, help="736 MB of the default model's")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    op = decode_attention_op()
    if op is None:
        raise SystemExit("decode_attention does not run here (pdserve's CPU kernels)")
    torch.set_num_threads(args.threads)
    points = [(int(r), int(c)) for c in args.context.split(",") for r in args.rows.split(",")]
    alone = [
        "| rows | context | L2 ms | L1 ms | L1 / L2 (quartiles) | GB/s (L2, L1) |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for rows, context in points:
        times, nbytes = attention_alone(op, rows, context, args.rounds, args.pool_blocks)
        rates = ", ".join(f"{nbytes / statistics.median(times[s]) / 1e9:.1f}" for s in SIDES)
        alone.append(f"| {rows} | {context} | {paired(times)} | {rates} |")
        print(alone[-1], flush=True)
    steps = [
        "| rows | context | L2 ms | L1 ms | L1 / L2 (quartiles) |",
        "|---:|---:|---:|---:|---|",
    ]
    for rows, context in points if args.steps else []:
        steps.append(f"| {rows} | {context} | {paired(decode_steps(rows, context, args.steps))} |")
        print(steps[-1], flush=True)
    cmd = " ".join(["python -m benchmarks.engine.kv_prefetch_ab", *sys.argv[1:]])
    text = [
        "# Decode attention's context prefetched into L1 or into L2",
        "",
        f"Command: `{cmd}`. {args.threads} threads. Load average at the end: {load_average()}.",
        "",
        f"### Attention alone: 30 layers, caches flushed each round ({args.rounds} rounds a side)",
        "",
        *alone,
    ]
    if args.steps:
        text += [
            "",
            f"### A decode step, layers from Python ({args.steps} steps a side)",
            "",
            *steps,
        ]
    args.out.write_text("\n".join([*text, "", *machine_block()]) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
