"""The decode step against the bare math of its layers, in one run.

    python -m benchmarks.engine_step [--model DIR|FILE.gguf] [--quantization auto] \
        [--batches 1,8] [--context 300] [--threads 2] [--rounds 30]

"Step": ``ModelRunner.decode`` on a batch of ``B`` sequences with ``--context`` tokens of KV
each (metadata, embedding, 30 layers, head; no sampling). "Bare math": the same model's
own linear layers (the very kernels the step uses, packed or dense) and one decode SDPA
call per layer over a (B, KV heads, context, head dim) cache, on random inputs of the step's
shapes, with nothing around them. Both are timed interleaved, round by round, and each
side's median is kept, so load on a shared machine hits both alike. The ratio step / bare
is the overhead around the math (target <= 1.15x). Writes
``benchmarks/results/engine_step.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.machine import describe as describe_machine
from checkpoints.default_model import resolve_model
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.model.attention import grouped_decode_sdpa
from engine.runner import ModelRunner
from engine.weights.linear import Linear
from wire.params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine_step.md"


def _bare(runner: ModelRunner, b: int, context: int) -> object:
    """A closure running the step's math alone: every linear layer and one SDPA per layer."""
    m = runner.model_config
    model = runner.model
    dtype = runner.dtype
    x = torch.randn(b, m.hidden_size, dtype=dtype)
    layers = [model.layer(i) for i in range(m.num_layers)]
    inter = torch.randn(b, m.intermediate_size, dtype=dtype)
    attn_out = torch.randn(b, m.num_heads * m.head_dim, dtype=dtype)
    q = torch.randn(b, m.num_heads, m.head_dim, dtype=dtype)
    kv = torch.randn(2, b, m.num_kv_heads, context, m.head_dim, dtype=dtype)
    bias = torch.zeros(b, 1, 1, context, dtype=dtype)

    def run() -> None:
        with torch.inference_mode():
            for layer in layers:
                layer.attn.qkv(x)
                grouped_decode_sdpa(q, kv[0], kv[1], bias)
                layer.attn.o(attn_out)
                layer.mlp.gate_up(x)
                layer.mlp.down(inter)
            model.lm_head(x)

    return run


def measure(runner: ModelRunner, b: int, context: int, rounds: int) -> tuple[float, float]:
    """(median step ms, median bare ms) at batch ``b``."""
    seqs = [Sequence(i, [(7 * i + j) % 1000 + 10 for j in range(context)],
                     sampling=SamplingParams()) for i in range(b)]  # fmt: skip
    runner.prefill([(s, s.num_tokens) for s in seqs])
    for s in seqs:
        s.output_ids.append(11)
    bare = _bare(runner, b, context)
    steps, bares = [], []
    for _ in range(rounds + 3):
        t0 = time.perf_counter()
        runner.decode(seqs)
        t1 = time.perf_counter()
        bare()  # type: ignore[operator]
        t2 = time.perf_counter()
        steps.append(t1 - t0)
        bares.append(t2 - t1)
        for s in seqs:
            s.output_ids.append(11)
    for s in seqs:
        runner.free_blocks(s)
    return statistics.median(steps[3:]) * 1e3, statistics.median(bares[3:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_step", description=__doc__)
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--quantization", default="auto,none")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    rows = []
    for quantization in args.quantization.split(","):
        runner = ModelRunner(EngineConfig(model=str(model), quantization=quantization,
                                          kv_cache_tokens=16 * (args.context + 64) * 8))  # fmt: skip
        kind_names = sorted({m.kind for m in runner.model.modules() if isinstance(m, Linear)})
        for b in (int(x) for x in args.batches.split(",")):
            step, bare = measure(runner, b, args.context, args.rounds)
            rows.append((quantization, runner.quantization, "/".join(kind_names), b, step, bare))
            print(f"{quantization} B={b}: step {step:.2f} ms, bare {bare:.2f} ms, "
                  f"{step / bare:.2f}x", flush=True)  # fmt: skip
    cmd = "python -m benchmarks.engine_step" + (f" --model {args.model.name}" if args.model else "")
    lines = [
        "# Decode step vs the bare math of its layers",
        "",
        f"Model `{model.name}`, context {args.context} tokens, {args.threads} threads, "
        f"median of {args.rounds} interleaved rounds. Command: `{cmd}`",
        "",
        "| --quantization | served as | linear kinds | batch | step ms | bare math ms | step / bare |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for q, served, kinds, b, step, bare in rows:
        lines.append(f"| {q} | {served} | {kinds} | {b} | {step:.2f} | {bare:.2f} | "
                     f"{step / bare:.2f}x |")  # fmt: skip
    lines += ["", "Machine:", "", "```", describe_machine(), "```", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
