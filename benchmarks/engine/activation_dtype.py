"""The served default model with float32 against bfloat16 activations, side by side.

    python -m benchmarks.engine.activation_dtype [--model DIR|FILE.gguf] [--batches 1,8,32] \
        [--context 300] [--prefill 256] [--rounds 30] [--out FILE]

Packed layers compute in bfloat16 whatever ``--dtype`` says; what it decides on CPU is
the rest: the residual stream, norms and rotary in float32 (``auto``, the default) or in
bfloat16 (``launch --dtype bfloat16``, as vLLM's bfloat16 CPU build serves), where the
float32 side pays a cast each way around every GEMM. Both engines are built as ``launch``
builds them (weights in a host segment, the fused backend where it loads) and their steps
are timed in turns, round by round, so load on a shared machine hits both alike: decode
steps of ``--batches`` sequences with ``--context`` tokens of KV and a ``--prefill``-token
prefill, medians. Quality is ``benchmarks.engine.perplexity``'s: the ``auto`` and ``auto+gemm``
storages (every call on the packed kernel, every call on the GEMM) at each dtype against
float32 dense weights. Writes ``benchmarks/results/activation_dtype.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine.engine_step import step_arguments, timed_decode
from benchmarks.engine.perplexity import TEXT, load_tokenizer, score
from benchmarks.harness.machine import load_average, machine_block
from bundled_models.default_model import resolve_model
from engine.build import build_engine
from engine.checkpoint.weights_segment import create_segment
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from wire.params import SamplingParams

RESULTS = Path(__file__).parents[1] / "results" / "activation_dtype.md"
DTYPES = ("auto", "bfloat16")


def _runner(model: Path, dtype: str, tokens: int) -> ModelRunner:
    return build_engine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            quantization="auto",
            kv_cache_tokens=tokens,
            large_batch_gemm=True,
            weights_fd=create_segment(),
        )
    ).runner


class _Prompts:
    """Distinct token sequences (no prefix shared between them or across engines)."""

    def __init__(self) -> None:
        self.rid = 0

    def take(self, n: int, length: int) -> list[Sequence]:
        out = []
        for _ in range(n):
            self.rid += 1
            ids = [(7 * self.rid + j) % 1000 + 10 for j in range(length)]
            out.append(Sequence(self.rid, ids, sampling=SamplingParams()))
        return out


def steps(
    runners: dict[str, ModelRunner], batches: list[int], context: int, prefill: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Median ms per step kind (``decode, batch B``, ``prefill, N tokens``) and dtype."""
    prompts = _Prompts()
    out: dict[str, dict[str, float]] = {}
    for b in batches:
        seqs = {d: prompts.take(b, context) for d in runners}
        for d, r in runners.items():
            r.prefill([(s, s.num_tokens) for s in seqs[d]])
            for s in seqs[d]:
                s.output_ids.append(11)
        times: dict[str, list[float]] = {d: [] for d in runners}
        for _ in range(rounds + 3):
            for d, r in runners.items():
                times[d].append(timed_decode(r, seqs[d]))
        for d, r in runners.items():
            for s in seqs[d]:
                r.kv.free_blocks(s)
        out[f"decode, batch {b}"] = {d: statistics.median(t[3:]) * 1e3 for d, t in times.items()}
    times = {d: [] for d in runners}
    for _ in range(rounds // 3 + 2):
        for d, r in runners.items():
            (seq,) = prompts.take(1, prefill)
            t0 = time.perf_counter()
            r.prefill([(seq, prefill)])
            times[d].append(time.perf_counter() - t0)
            r.kv.free_blocks(seq)
    out[f"prefill, {prefill} tokens"] = {
        d: statistics.median(t[2:]) * 1e3 for d, t in times.items()
    }
    return out


def quality(model: Path) -> list[tuple[str, float, float, float]]:
    """(storage, perplexity, ratio to float32 dense, argmax agreement with it) per row."""
    ids = load_tokenizer(str(model))(TEXT.read_text()).input_ids
    ref, ref_argmax = score(model, "none", ids, 512, False)
    rows = [("none", math.exp(ref), 1.0, 1.0)]
    for storage in ("auto", "auto+gemm", "auto@bfloat16", "auto+gemm@bfloat16"):
        nll, argmax = score(model, storage, ids, 512, False)
        agree = sum(a == b for a, b in zip(argmax, ref_argmax, strict=True)) / len(argmax)
        rows.append((storage, math.exp(nll), math.exp(nll - ref), agree))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.activation_dtype", description=__doc__
    )
    step_arguments(p, RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    batches = [int(x) for x in args.batches.split(",")]
    start_load = load_average()
    tokens = (args.context + 64) * max(batches) + 2 * args.prefill
    runners = {d: _runner(model, d, tokens) for d in DTYPES}
    timed = steps(runners, batches, args.context, args.prefill, args.rounds)
    del runners
    rows = quality(model)
    lines = [
        "# float32 against bfloat16 activations, the default model packed",
        "",
        f"Command: `{' '.join(['python -m benchmarks.engine.activation_dtype', *sys.argv[1:]])}`; "
        f"threads {args.threads}; load average at the start {start_load}, at the end "
        f"{load_average()}.",
        "",
        "| step | float32 (`--dtype auto`) ms | bfloat16 (`--dtype bfloat16`) ms | bfloat16 / float32 |",
        "|---|---:|---:|---:|",
    ]
    for what, ms in timed.items():
        ratio = ms["bfloat16"] / ms["auto"]
        lines.append(f"| {what} | {ms['auto']:.2f} | {ms['bfloat16']:.2f} | {ratio:.3f} |")
    lines += [
        "",
        f"Perplexity (`{TEXT.name}`, windows of 512, one prefill each) against float32 dense "
        "weights:",
        "",
        "| storage | perplexity | vs float32 | argmax = float32's |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {s} | {ppl:.4f} | {r:.4f}x | {a:.1%} |" for s, ppl, r, a in rows]
    lines += ["", *machine_block()]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines[:-8]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
