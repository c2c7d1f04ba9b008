"""Where a decode step's time goes, kernel by kernel, against the bytes each must read.

    python -m benchmarks.engine.step_roofline [--model DIR|FILE.gguf] [--rows 1,5] \
        [--context 300,2048] [--threads 2] [--seconds 3] [--out FILE]

The engine is built as ``launch`` serves on CPU (packed layers and their GEMMs, the
weights in a shared segment). At each context and row
count it runs steps of one sequence for ``--seconds`` under ``perf record`` of this process:
one row is a decode step (``ModelRunner.decode``), k + 1 rows a speculative verification of k
drafts (``ModelRunner.verify``). Each sequence runs 64 steps, then a fresh one of the same
context is prefilled (so the context stays within 64 tokens of ``--context``).

perf's samples are sorted into kernels by symbol and object: the packed GEMV (every linear
layer and the LM head: int4 tiles, the head's int8 as two int4 planes), decode attention,
the other pdserve kernels (norms, rotary, SiLU), OpenMP waits (libgomp: a thread done with
its share of a parallel region, or idle while the other runs serial code), torch, Python,
and the OS and C library. A kernel's "ms a step" is its sampled CPU time over the threads
(``perf -F`` samples a running thread ``F`` times a second); its rate is the bytes it must
read a step (the weights as the few-rows kernel holds them; the KV of the context) over
that time; the roofline is those bytes over the copy rate measured in the same run (read
and written bytes counted, as STREAM's copy counts them). ``perf`` must be on the PATH.
Writes ``benchmarks/results/step_roofline.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.engine.engine_step import copy_rate, step_bytes
from benchmarks.harness.machine import load_average, machine_block
from bundled_models.default_model import resolve_model
from engine.build import build_engine
from engine.checkpoint.weights_segment import create_segment
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from wire.params import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "step_roofline.md"
HZ = 1999
STEPS_PER_SEQUENCE = 64
# The packed GEMV's symbols: pair-dots (rows_block, panel_), AMX (tiles_kernel) and int8
# inputs (a8_*, widen_tile, quantize_rows: the avx512_vnni kernel, its rows quantized per call).
GEMV = (
    "rows_block",
    "tiles_kernel",
    "panel_",
    "int4_mm",
    "int4_gemm",
    "a8_",
    "widen_tile",
    "quantize_rows",
)
# (kernel, does it match a perf line's object and symbol); the first match wins.
KERNELS: list[tuple[str, tuple[str, ...]]] = [
    ("packed GEMV (layers and head)", GEMV),
    ("decode attention", ("decode_attention",)),
    ("other pdserve kernels", ("_kernels.cpython", "_C.abi3")),
    ("OpenMP waits", ("libgomp",)),
    ("torch", ("libtorch", "libc10")),
    ("Python", ("libpython",)),
]
OTHER = "OS, C library, rest"


def kernel_of(line: str) -> str:
    for name, keys in KERNELS:
        if any(k in line for k in keys):
            return name
    return OTHER


def perf_samples(data: Path) -> Counter[str]:
    """Samples per kernel in a finished ``perf record``."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "-g", "none", "-F", "sample,dso,sym"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    out: Counter[str] = Counter()
    for line in report.splitlines():
        head, _, rest = line.strip().partition(" ")
        if head.isdigit():
            out[kernel_of(rest)] += int(head)
    return out


def served_runner(model: Path | None, kv_tokens: int) -> ModelRunner:
    """``model`` (None: the embedded default) as ``launch`` serves it on CPU: packed layers
    and their GEMMs, the weights in a shared segment; a pool of ``kv_tokens``."""
    config = EngineConfig(
        model=str(resolve_model(model)),
        kv_cache_tokens=kv_tokens,
        large_batch_gemm=True,
        weights_fd=create_segment(),
    )
    return build_engine(config).runner


def fresh(runner: ModelRunner, context: int, rid: int) -> Sequence:
    span = min(1000, runner.model_config.vocab_size - 10)
    seq = Sequence(
        rid, [(7 * rid + 3 * j) % span + 10 for j in range(context)], sampling=SamplingParams()
    )
    runner.prefill([(seq, context)])
    seq.output_ids.append(11)
    return seq


def one_step(runner: ModelRunner, seq: Sequence, rows: int) -> float:
    """Seconds of a decode step of ``seq`` (1 row; it is then given its next token) or of a
    verification of ``rows - 1`` drafts (the sequence stays where it is)."""
    t0 = time.perf_counter()
    if rows == 1:
        runner.decode([seq])
    else:
        runner.verify([seq], [[11 + j for j in range(rows - 1)]])
    took = time.perf_counter() - t0
    if rows == 1:
        seq.output_ids.append(11)
    return took


class PerfControl:
    """``perf record`` of this process, started disabled, switched on and off through its
    control FIFO (so the fresh sequences' prefills stay out of the samples)."""

    def __init__(self, data: Path) -> None:
        self.ctl, self.ack = data.with_suffix(".ctl"), data.with_suffix(".ack")
        os.mkfifo(self.ctl)
        os.mkfifo(self.ack)
        record = ["perf", "record", "-F", str(HZ), "-D", "-1", "-o", str(data)]
        control = f"--control=fifo:{self.ctl},{self.ack}"
        self.proc = subprocess.Popen(
            [*record, control, "-p", str(os.getpid())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Opening a FIFO blocks until perf opens its end: perf is up when these return.
        self.ctl_fd = os.open(self.ctl, os.O_WRONLY)
        self.ack_fd = os.open(self.ack, os.O_RDONLY)

    def switch(self, on: bool) -> None:
        os.write(self.ctl_fd, b"enable\n" if on else b"disable\n")
        os.read(self.ack_fd, 16)  # "ack\n" once perf acted on it

    def stop(self) -> None:
        os.close(self.ctl_fd)
        os.close(self.ack_fd)
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)


def run_steps(
    runner: ModelRunner, context: int, rows: int, seconds: float, perf: PerfControl | None = None
) -> list[float]:
    """Step times (s) of one sequence at ``context``: decodes (1 row) or verifications of
    ``rows - 1`` drafts, fresh sequences every ``STEPS_PER_SEQUENCE`` steps; ``perf`` on
    during the steps only."""
    times: list[float] = []
    end, rid = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        seq = fresh(runner, context, rid)
        if perf is not None:
            perf.switch(True)
        for _ in range(STEPS_PER_SEQUENCE):
            times.append(one_step(runner, seq, rows))
        if perf is not None:
            perf.switch(False)
        runner.kv.free_blocks(seq)
        rid += 1
    return times


def profile(
    runner: ModelRunner, context: int, rows: int, seconds: float
) -> tuple[float, int, Counter[str]]:
    """(median step s, steps, samples per kernel) for steps run under perf."""
    run_steps(runner, context, rows, 0.5)  # warm: blocks, caches, the kernels' scratch
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        perf = PerfControl(data)
        try:
            times = run_steps(runner, context, rows, seconds, perf)
        finally:
            perf.stop()
        samples = perf_samples(data)
    return statistics.median(times), len(times), samples


def kv_bytes(runner: ModelRunner, context: int) -> int:
    m = runner.model_config
    return context * m.num_layers * 2 * m.num_kv_heads * m.head_dim * runner.kv_dtype.itemsize


def table(
    runner: ModelRunner, context: int, rows: int, seconds: float, rate: float, threads: int
) -> list[str]:
    step, n, samples = profile(runner, context, rows, seconds)
    total = sum(samples.values())
    weights, kv = step_bytes(runner, 0, 0), kv_bytes(runner, context)
    what = "decode step" if rows == 1 else f"verification of {rows - 1} drafts"
    lines = [
        f"### {what}, context {context}: {1e3 * step:.2f} ms a step (median of {n}); "
        f"roofline {1e3 * (weights + kv) / rate:.2f} ms ({(weights + kv) / 1e6:.1f} MB: "
        f"weights {weights / 1e6:.1f}, KV {kv / 1e6:.1f}), step / roofline "
        f"{step * rate / (weights + kv):.2f}x",
        "",
        "| kernel | share of samples | ms a step | bytes a step | rate while it runs "
        "| of the copy rate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    # Samples over all threads -> thread-seconds, then per step and per thread.
    per_step = {k: v / HZ / max(1, n) / threads for k, v in samples.items()}
    reads = {KERNELS[0][0]: weights, KERNELS[1][0]: kv}
    for name in [k for k, _ in KERNELS] + [OTHER]:
        if not samples.get(name):
            continue
        ms, got = 1e3 * per_step[name], reads.get(name)
        speed = f"{got / (ms / 1e3) / 1e9:.1f} GB/s" if got else ""
        share = f"{100 * got / (ms / 1e3) / rate:.0f} %" if got else ""
        lines.append(
            f"| {name} | {100 * samples[name] / total:.1f} % | {ms:.2f} | "
            f"{f'{got / 1e6:.1f} MB' if got else ''} | {speed} | {share} |"
        )
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.step_roofline", description=__doc__
    )
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--rows", default="1,5", help="1: decode; k + 1: a verification of k drafts")
    p.add_argument("--context", default="300,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if shutil.which("perf") is None:
        p.error("perf must be on the PATH")
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.context.split(",")]
    runner = served_runner(args.model, 2 * (max(contexts) + STEPS_PER_SEQUENCE + 64))
    rate = copy_rate()
    body: list[str] = []
    for context in contexts:
        for rows in (int(r) for r in args.rows.split(",")):
            body += table(runner, context, rows, args.seconds, rate, args.threads)
            print("\n".join(body[-12:]), flush=True)
    given = [a if not a.startswith("/") else Path(a).name for a in sys.argv[1:]]
    cmd = " ".join(["python -m benchmarks.engine.step_roofline", *given])
    head = [
        "# A decode step's time by kernel, against the bytes each reads",
        "",
        f"Command: `{cmd}`. {args.threads} threads; copy rate {rate / 1e9:.1f} GB/s (a 256 MB "
        f"copy, read and written bytes counted, best of 5). Load average at the end: "
        f"{load_average()}. How the kernels are told apart and timed: the module's docstring "
        "(`benchmarks/engine/step_roofline.py`).",
        "",
    ]
    args.out.write_text("\n".join([*head, *body, *machine_block()]) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
