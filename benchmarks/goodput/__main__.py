"""Command line of the goodput benchmark; see the package docstring.

    python -m benchmarks.goodput --slo-ttft-ms 2000 --slo-tpot-ms 60
    python -m benchmarks.goodput --configs 1p2d,colocated2 --traces phased --phase-s 30
    python -m benchmarks.goodput --base-url http://127.0.0.1:8000 --tokenizer <dir>

Without ``--base-url`` it launches each configuration of ``--configs`` in turn on a free
loopback port (the default model unless ``--model``), warms it, sweeps the rates of every
trace, and stops it; the page, its JSON and the plot are rewritten after each one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.goodput.configs import (
    ServerConfig,
    default_configs,
    launch_has_workers,
    parse_config,
)
from benchmarks.goodput.drive import Prompts, Target, roles_seen, run_point, wait_quiet, warm
from benchmarks.goodput.report import (
    Point,
    Run,
    merge_runs,
    plot,
    read_json,
    render,
    write_json,
)
from benchmarks.goodput.slo import Slo
from benchmarks.goodput.traces import TRACES, request_count, schedule
from benchmarks.harness.machine import describe, load_average, portable

logger = logging.getLogger("benchmarks.goodput")
DEFAULT_RATES = {"chat": "0.25,0.5,1,1.5,2", "doc": "0.25,0.5,1,1.5,2", "phased": "0.25,0.5,1,1.5"}
QUIET_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__)
    a = p.add_argument
    a("--configs", help=f"comma-separated (default here: {','.join(default_configs())})")
    a("--traces", default="chat,doc,phased", help=f"comma-separated of {','.join(TRACES)}")
    a("--rates", action="append", default=[], metavar="TRACE=R1,R2", help="req/s per trace")
    a("--slo-ttft-ms", type=float, help="default 2000 (--from-json: the recorded one)")
    a("--slo-tpot-ms", type=float, help="default 100 (--from-json: the recorded one)")
    a("--trace-slo", action="append", default=[], metavar="TRACE=TTFT_MS:TPOT_MS")
    a(
        "--from-json",
        type=Path,
        action="append",
        help="judge a recorded run's requests at these SLOs (repeatable: runs merged, a "
        "later run's point replacing an earlier one's at the same rate)",
    )
    a("--duration-s", type=float, default=60.0, help="steady traces: seconds of arrivals")
    a("--phase-s", type=float, default=180.0, help="phased trace: seconds a phase")
    a("--min-requests", type=int, default=8, help="least requests a point sends")
    a("--max-requests", type=int, default=200, help="most requests a point sends")
    a("--drain-s", type=float, default=60.0, help="after the last arrival, then cut")
    a("--stop-below", type=float, default=0.5, help="skip higher rates below this")
    a("--seed", type=int, default=0)
    a("--base-url", help="measure this running OpenAI-compatible server instead")
    a("--label", default="server", help="with --base-url: its name on the page")
    a("--model", help="launched servers' --model (default: the embedded SmolLM2's dir)")
    a("--tokenizer", help="tokenizer dir or name (default: the launched model's)")
    a("--launch-args", default="", help="more arguments for every launched server")
    a("--tree", type=Path, help="serve from this copy of the code (default: this checkout)")
    a("--note", action="append", default=[], help="a line for the page (repeatable)")
    a("--warm-concurrency", type=int, default=4)
    a("--out", type=Path, default=Path("benchmarks/results/goodput"), help="<out>.md/.png")
    args = p.parse_args(argv)
    if not 0 <= args.stop_below <= 1:
        p.error("--stop-below is a fraction in [0, 1]")
    return args


def rates_by_trace(specs: list[str], traces: list[str]) -> dict[str, list[float]]:
    """``["chat=1,2"]`` over the defaults; every rate positive, each trace's sorted."""
    given = dict(DEFAULT_RATES)
    for spec in specs:
        trace, sep, values = spec.partition("=")
        if not sep or trace not in TRACES:
            raise ValueError(f"--rates {spec!r}: use TRACE=R1,R2 with TRACE one of {list(TRACES)}")
        given[trace] = values
    out = {}
    for trace in traces:
        rates = sorted({float(v) for v in given[trace].split(",")})
        if not rates or rates[0] <= 0:
            raise ValueError(f"--rates {trace}: rates must be positive, got {given[trace]}")
        out[trace] = rates
    return out


def served_model(base_url: str) -> str:
    models = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"]
    return str(models[0]["id"])


def sweep(run: Run, target: Target, config: str, tokenizer: Any, args: argparse.Namespace) -> None:
    """Every trace's rates against one running server, lowest rate first."""
    for t_index, trace in enumerate(run.traces):
        phases = TRACES[trace]
        duration = len(phases) * args.phase_s if len(phases) > 1 else args.duration_s
        missed: float | None = None
        for r_index, rate in enumerate(args.rates[trace]):
            if missed is not None:
                why = f"{100 * missed:.0f} % at a lower rate"
                run.points.append(Point(config, trace, rate, skipped=why))
                continue
            seed = args.seed * 10_000 + t_index * 100 + r_index  # the same for every config
            count = request_count(rate, duration, args.min_requests, args.max_requests)
            arrivals = schedule(phases, rate, count, args.phase_s, seed)
            start = time.perf_counter()
            sent = asyncio.run(run_point(target, arrivals, Prompts(tokenizer, seed), args.drain_s))
            roles = roles_seen(target.base_url)  # "" but for --workers
            point = Point(
                config, trace, rate, tuple(sent), time.perf_counter() - start, roles=roles
            )
            run.points.append(point)
            s = point.summary(run.slo_for(trace))
            logger.info(
                "%s %s %.2f req/s: %d requests, attainment %.0f %%, TTFT p50 %s ms, TPOT p50 %s "
                "ms, %d failed (%.0f s)",
                config, trace, rate, s["requests"], 100 * s["attainment"], s["ttft_p50_ms"],
                s["tpot_p50_ms"], s["failed"], point.seconds,
            )  # fmt: skip
            if s["attainment"] < args.stop_below:
                missed = s["attainment"]
            if wait_quiet(target.base_url, QUIET_TIMEOUT_S) is False:
                run.notes.append(f"{config}: still busy {QUIET_TIMEOUT_S:g} s after {trace}@{rate}")


def measure_launched(run: Run, config: ServerConfig, args: argparse.Namespace, tok: Any) -> None:
    from benchmarks.harness.servers import launch

    signal.signal(signal.SIGTERM, _stop)  # a stopped run stops its server too (finally)
    launch_args = ["--model", args.model, *config.launch_args, *shlex.split(args.launch_args)]
    if config.adaptive:  # the planner holds the targets the benchmark measures against
        launch_args += ["--slo-ttft-ms", f"{run.slo.ttft_ms:g}"]
        launch_args += ["--slo-tpot-ms", f"{run.slo.tpot_ms:g}"]
    load_start = os.getloadavg()[0]
    try:
        proc, url = launch(launch_args, tree=args.tree)
    except RuntimeError as e:
        run.notes.append(f"{config.name}: did not start ({e}); not measured")
        return
    try:
        target = Target(url, served_model(url))
        errors = asyncio.run(warm(target, Prompts(tok, 2**31), args.warm_concurrency))
        if errors:
            run.notes.append(f"{config.name}: warm-up errors {sorted(set(errors))}")
        wait_quiet(url, QUIET_TIMEOUT_S)
        sweep(run, target, config.name, tok, args)
    finally:
        run.loads[config.name] = (load_start, os.getloadavg()[0])
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def write(run: Run, out: Path, ended: bool = True) -> None:
    """The page, its JSON and the plot; ``ended``: stamp the load and machine of now."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if ended:
        run.load_after, run.machine = load_average(), describe()
    plot(run, out.with_suffix(".png"))
    write_json(run, out.with_suffix(".json"))
    machine = ["Machine:", "", "```", run.machine, "```", ""]
    md = render(run, out.with_suffix(".png").name, machine)
    out.with_suffix(".md").write_text(md + "\n")


def trace_slos(specs: list[str]) -> dict[str, Slo]:
    """``["doc=30000:300"]`` -> ``{"doc": Slo(30000, 300)}``."""
    out = {}
    for spec in specs:
        trace, _, values = spec.partition("=")
        ttft, sep, tpot = values.partition(":")
        if trace not in TRACES or not sep:
            raise ValueError(
                f"--trace-slo {spec!r}: use TRACE=TTFT_MS:TPOT_MS, TRACE of {list(TRACES)}"
            )
        out[trace] = Slo(float(ttft), float(tpot))
    return out


def rejudge(args: argparse.Namespace, command: str) -> int:
    """``--from-json``: the recorded requests judged at the given SLOs, written to --out."""
    runs = [read_json(path) for path in args.from_json]
    run = merge_runs(runs)
    run.slo = Slo(args.slo_ttft_ms or run.slo.ttft_ms, args.slo_tpot_ms or run.slo.tpot_ms)
    run.trace_slos = trace_slos(args.trace_slo)
    page = args.from_json[0].with_suffix(".md")
    if not run.machine and page.exists():  # recorded before the JSON kept the machine
        run.machine = page.read_text().split("Machine:\n\n```\n", 1)[-1].split("\n```", 1)[0]
    recorded = ", ".join(portable(str(path)) for path in args.from_json)
    run.notes.append(
        f"judged at the SLOs above by `{command}` from the requests recorded ({recorded}); "
        "the runs themselves were measured by the command(s) above"
    )
    run.notes += args.note
    write(run, args.out, ended=False)
    return 0


def _tokenizer(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer or args.model)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "rates (req/s)": "; ".join(f"{t}: {', '.join(map(str, r))}" for t, r in args.rates.items()),
        "requests a point": f"rate x {args.duration_s:g} s (steady) or x one phase cycle "
        f"of {args.phase_s:g} s phases (phased), within [{args.min_requests}, "
        f"{args.max_requests}]",
        "deadline": f"a point's requests still running {args.drain_s:g} s after its last "
        "arrival are cut and judged on what they showed by then (TTFT; the mean gap between "
        "their chunks so far as TPOT; under two chunks: a miss); the tables count them",
        "higher rates skipped": f"after a point under {100 * args.stop_below:.0f} % attainment",
        "prompts": "random vocabulary, exactly the drawn length in the model's tokens; outputs "
        "forced to length with ignore_eos; /v1/completions, streamed, greedy",
    }


def _revision(tree: Path | None) -> str:
    """The code measured: HEAD, and whether tracked files differ from it (this checkout
    is shared; launched servers run the working tree, or ``tree``)."""
    if tree is not None and not (tree / ".git").exists():
        return f"served from {tree} (a copy, not a git checkout: see the notes)"
    git = ["git", "-C", str(tree or Path(__file__).resolve().parents[2])]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}" + (
        f", {len(dirty)} tracked files changed in the working tree" if dirty else ""
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    traces = [t for t in args.traces.split(",") if t]
    if unknown := set(traces) - set(TRACES):
        raise SystemExit(f"--traces: unknown {sorted(unknown)}; choose from {list(TRACES)}")
    command = portable("python -m benchmarks.goodput " + shlex.join(argv or sys.argv[1:]))
    try:
        if args.from_json:
            return rejudge(args, command)
        args.rates = rates_by_trace(args.rates, traces)
        slo = Slo(args.slo_ttft_ms or 2000.0, args.slo_tpot_ms or 100.0)
        per_trace = trace_slos(args.trace_slo)
        configs = [
            parse_config(c) for c in (args.configs or ",".join(default_configs())).split(",")
        ]
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if args.model is None and args.base_url is None:
        from bundled_models.default_model import default_model_dir

        args.model = str(default_model_dir())
    tokenizer = _tokenizer(args)
    names = [args.label] if args.base_url else [c.name for c in configs]
    run = Run(command, slo, traces, names, _settings(args), load_before=load_average())
    run.trace_slos = per_trace
    run.settings["host"] = f"{os.cpu_count()} cores, loopback"
    run.settings["code"] = _revision(args.tree)
    run.notes += args.note
    if args.base_url:
        sweep(run, Target(args.base_url, served_model(args.base_url)), args.label, tokenizer, args)
    else:
        has_workers = launch_has_workers(args.tree)
        for config in configs:
            if config.adaptive and not has_workers:
                note = f"{config.name}: skipped, `launch --help` has no --workers here"
                print(note, flush=True)
                run.notes.append(note)
                continue
            measure_launched(run, config, args, tokenizer)
            write(run, args.out)
    write(run, args.out)
    logger.info("wrote %s", args.out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
