"""What batch-invariant serving costs: the same load with the switch off and on.

    python -m benchmarks.determinism [--streams 1,8,32] [--input-len 256]
        [--output-len 64] [--rounds 1] [--flags "--colocated 1"] [--out FILE]
    python -m benchmarks.determinism --engine [--streams 1,8,32] [--input-len 256]
        [--rounds 15] [--out FILE]

``--engine``: in one process, two engines on the default model as a worker builds it
(packed layers, the bfloat16 GEMM from the crossover measured at load), one with the
switch on; a decode step of ``B`` rows (``--input-len`` tokens of context each) timed on
each, interleaved round by round (``benchmarks.engine.engine_step.measure``), medians kept: the
cost at the step, which load on a shared machine hits on both sides alike.

Serves the default model with ``--flags`` (co-located by default), then with the same
flags and ``--enable-deterministic-inference``, one server at a time (the order swapped
every round), and drives each with ``python -m benchmarks.serving`` at every stream count
in turn (random prompts, greedy, ``ignore_eos``; ``2 x streams`` prompts, at least 8, the
same prompts for both servers in a round). Reported: output tokens/s and ITL p50 per
server and stream count, and on / off side by side. Writes
``benchmarks/results/determinism.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import statistics
from pathlib import Path

from benchmarks.harness.machine import load_average
from benchmarks.harness.servers import launch
from benchmarks.serving.launch_ab import write_page
from benchmarks.serving.load_ab import run_client
from bundled_models.default_model import DEFAULT_MODEL_NAME, default_model_dir

RESULTS = Path(__file__).parent / "results" / "determinism.md"
SWITCH = "--enable-deterministic-inference"
METRICS = {
    "output_throughput": "out tok/s",
    "p50_itl_ms": "ITL p50 ms",
    "p50_ttft_ms": "TTFT p50 ms",
}


def _drive(url: str, model: str, streams: int, args: argparse.Namespace, seed: int) -> dict:
    """One load of ``streams`` requests in flight against ``url``: the client's metrics."""
    load = [
        *("--max-concurrency", str(streams), "--num-prompts", str(max(8, 2 * streams))),
        *("--random-input-len", str(args.input_len), "--random-range-ratio", "0"),
        *("--random-output-len", str(args.output_len)),
    ]
    try:
        data = run_client(url, model, seed, load)
    except RuntimeError as e:
        raise RuntimeError(f"{streams} streams: {e}") from e
    return {key: float(data[key]) for key in METRICS}


def _serve(flags: str, model: str, args: argparse.Namespace, seed: int) -> dict[int, dict]:
    """Launch ``flags``, run every stream count against it, stop it."""
    proc, url = launch(
        ["--model", model, "--served-model-name", DEFAULT_MODEL_NAME, *shlex.split(flags)]
    )
    try:
        return {n: _drive(url, model, n, args, seed) for n in args.streams}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def _table(got: dict[str, list[dict[int, dict]]], streams: list[int]) -> list[str]:
    lines = [
        "| streams | off out tok/s | on out tok/s | on / off | off ITL p50 ms | on ITL p50 ms "
        "| on / off | off TTFT p50 ms | on TTFT p50 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in streams:

        def med(name: str, key: str, n: int = n) -> float:
            return statistics.median(r[n][key] for r in got[name])

        tput = (med("off", "output_throughput"), med("on", "output_throughput"))
        itl = (med("off", "p50_itl_ms"), med("on", "p50_itl_ms"))
        ttft = (med("off", "p50_ttft_ms"), med("on", "p50_ttft_ms"))
        lines.append(
            f"| {n} | {tput[0]:.1f} | {tput[1]:.1f} | {tput[1] / tput[0]:.3f}x | {itl[0]:.2f} "
            f"| {itl[1]:.2f} | {itl[1] / itl[0]:.3f}x | {ttft[0]:.1f} | {ttft[1]:.1f} |"
        )
    return lines


def _engine(args: argparse.Namespace, model: str) -> list[str]:
    """The decode step with the switch off and on, interleaved: a table's lines."""
    from benchmarks.engine.engine_step import measure
    from engine.build import build_engine
    from engine.config import EngineConfig

    context = args.input_len
    runners = {
        name: build_engine(
            EngineConfig(
                model=model,
                kv_cache_tokens=16 * (context + 64) * max(args.streams),
                large_batch_gemm=True,
                deterministic=name == "on",
            )
        ).runner
        for name in ("off", "on")
    }
    lines = [
        "| decode rows | off step ms | on step ms | on / off | off tok/s | on tok/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for b in args.streams:
        ms, _ = measure(runners, b, context, args.rounds)
        lines.append(
            f"| {b} | {ms['off']:.2f} | {ms['on']:.2f} | {ms['on'] / ms['off']:.3f}x "
            f"| {b * 1e3 / ms['off']:.1f} | {b * 1e3 / ms['on']:.1f} |"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.determinism", description=__doc__)
    p.add_argument("--streams", default="1,8,32", help="stream counts, comma-separated")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--flags", default="--colocated 1", help="launch flags of both servers")
    p.add_argument("--engine", action="store_true", help="decode steps in-process instead")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    model = str(default_model_dir())
    start_load = load_average()
    if args.engine:
        lines = _engine(args, model)
        write_page(
            "Batch-invariant serving: its cost at the decode step",
            f"Command: `python -m benchmarks.determinism --engine --streams "
            f"{','.join(map(str, args.streams))} --input-len {args.input_len} --rounds "
            f"{args.rounds}`; the default model, a worker's engine (packed layers, the GEMM "
            f"from the crossover measured at load), medians of interleaved rounds. Load "
            f"average at the start: {start_load}; at the end: {load_average()}.",
            lines,
            args.out,
        )
        return
    got: dict[str, list[dict[int, dict]]] = {"off": [], "on": []}
    flags = {"off": args.flags, "on": f"{args.flags} {SWITCH}"}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            got[name].append(_serve(flags[name], model, args, seed=r))
            print(name, r, got[name][-1], flush=True)
    lines = _table(got, args.streams)
    lines += ["", "Each run:", ""]
    for name in ("off", "on"):
        for r, runs in enumerate(got[name]):
            cells = "; ".join(
                f"{n} streams " + ", ".join(f"{col} {runs[n][k]:.2f}" for k, col in METRICS.items())
                for n in args.streams
            )
            lines.append(f"- {name}, round {r + 1}: {cells}")
    write_page(
        "Batch-invariant serving: its cost",
        f"Command: `python -m benchmarks.determinism --streams "
        f"{','.join(map(str, args.streams))} --input-len {args.input_len} --output-len "
        f"{args.output_len} --rounds {args.rounds} --flags {shlex.quote(args.flags)}`; the "
        f"default model, random prompts, greedy, `ignore_eos`, medians over the rounds. Load "
        f"average at the start: {start_load}; at the end: {load_average()}.",
        lines,
        args.out,
    )


if __name__ == "__main__":
    main()
