"""Command line of the head-to-head; see the package docstring."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.machine import load_average, portable, vector_flags
from benchmarks.harness.servers import (
    VLLM_SPEC,
    ServerFailed,
    ServerSpec,
    ensure_vllm,
    running,
    vllm_version,
)
from benchmarks.peers import llama_cpp
from benchmarks.peers.contenders import (
    LLAMA,
    PDSERVE_QUANTS,
    PRECISIONS,
    ROOT,
    TOPOLOGIES,
    VLLM,
    Settings,
    launch_help,
    llama_server,
    pdserve_server,
    resolve_model,
    vllm_server,
)
from benchmarks.peers.files import gguf_files, roofline
from benchmarks.peers.report import Point, Report, render
from benchmarks.peers.shapes import SHAPES, ensure_shape
from benchmarks.peers.workloads import WORKLOADS, measure, warm_up

logger = logging.getLogger("benchmarks.peers")


@dataclass
class Group:
    """The servers measured together: one precision, pdserve's variants and the peers."""

    precision: str
    ours: list[ServerSpec] = field(default_factory=list)
    peers: list[ServerSpec] = field(default_factory=list)

    @property
    def specs(self) -> list[ServerSpec]:
        return [*self.peers, *self.ours]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    a = p.add_argument
    a(
        "--model",
        type=Path,
        default=None,
        help="HF checkpoint dir (default: pdserve's cached default model, where that exists)",
    )
    a(
        "--shape",
        default=None,
        help="random weights of a larger model's shapes, made from --model's config and "
        f"tokenizer (benchmarks/peers/shapes.py): one of {', '.join(SHAPES)}",
    )
    a("--dtype", default="float32", help="for every server")
    a("--concurrency", default="1,4,8", help="comma-separated levels")
    a("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    a("--rounds", type=int, default=2, help="prompts per point = max(--min-prompts, rounds x c)")
    a("--min-prompts", type=int, default=4)
    a("--kv-cache-gib", type=int, default=1, help="vLLM's KV space; each pdserve worker's")
    a(
        "--vllm-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N, pinned; `nobind`: as many "
        "threads, unpinned)",
    )
    a("--max-model-len", type=int, default=2048)
    a("--pdserve", default=",".join(TOPOLOGIES), help=f"of {','.join(TOPOLOGIES)}")
    a(
        "--pdserve-quant",
        default="none,int8,int4,gguf-q4_1",
        help=f"pdserve's weight variants, of {','.join(PDSERVE_QUANTS)}; each is run in every "
        "--pdserve topology",
    )
    a(
        "--precisions",
        default=",".join(PRECISIONS),
        help="groups to run (F32 stands for the unquantized --dtype); the peers run in each",
    )
    a("--venv", type=Path, default=ROOT / ".peers-venv", help="where vllm-cpu is installed")
    a("--vllm-spec", default=VLLM_SPEC)
    a("--no-vllm", action="store_true", help="leave vLLM out")
    a(
        "--no-vllm-bf16",
        action="store_true",
        help="no vLLM bfloat16 row in the Q4_1 group (it runs where the CPU has native bf16)",
    )
    a(
        "--llama-dir",
        type=Path,
        default=llama_cpp.LLAMA_DIR,
        help="where llama.cpp is built and its GGUFs are made",
    )
    a("--llama-spec", default=llama_cpp.LLAMA_CPP_SPEC, help="the sdist carrying its source")
    a("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    a(
        "--dry-run",
        action="store_true",
        help="print every server's command line and exit (builds and converts nothing)",
    )
    a("--request-timeout", type=float, default=300.0, help="seconds per request")
    a("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peers_cpu.md")
    a(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="rewrite --out from a results JSON this command wrote (no servers, no load)",
    )
    return p.parse_args(argv)


def _names(value: str, known: Sequence[str], flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"{flag}: unknown {unknown} (known: {', '.join(known)})")
    return names


def pdserve_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--", ".").strip() else ""
    return git("log", "-1", "--format=%h %s").strip()[:100] + dirty


def vector_line() -> str:
    """The vector extensions that decide which kernels the servers can use, and the load."""
    cpu = llama_cpp.cpu_flags()
    wanted = sorted(
        {f for need in llama_cpp.VECTOR_OPTIONS.values() for f in need}
        | {"amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}
    )
    load = load_average()
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "unknown",
    )
    return (
        f"CPU {model}; vector flags: {' '.join(f for f in wanted if f in cpu) or 'none'}; "
        f"load average at start {load}"
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SIGTERM (a timeout, a CI runner) unwinds like Ctrl-C, so every server is still stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.render is not None:
        doc = json.loads(args.render.read_text())
        report = Report(**doc["report"])
        args.out.write_text(portable(render(report, [Point(**p) for p in doc["points"]])) + "\n")
        return 0
    command = "python -m benchmarks.peers " + shlex.join(sys.argv[1:] if argv is None else argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = _names(args.workloads, list(WORKLOADS), "--workloads")
    model = resolve_model(args.model)
    if args.shape is not None:
        model = ensure_shape(args.llama_dir, args.shape, model)
    settings = Settings(
        model,
        args.dtype,
        args.kv_cache_gib,
        args.max_model_len,
        os.cpu_count() or 1,
        max(levels),
    )
    groups, failures, setup = plan(args, settings)
    if args.dry_run:
        for g in groups:
            print(f"# {g.precision}")
            for spec in g.specs:
                print(f"{spec.name}: {spec.describe()}")
        return 0
    setup = [
        f"model: `{settings.model}` ({settings.served_name}), `--dtype {settings.dtype}` "
        "for pdserve and vLLM (pdserve's quantized rows compute as `launch "
        "--quantization` says), llama.cpp's GGUFs as each row names them, max model "
        f"len {settings.max_model_len}",
        *setup,
        f"pdserve at {pdserve_commit()}",
        *(f"{s.name}: `{s.describe()}`" for g in groups for s in g.specs),
    ]
    setup += roofline([arg for g in groups for spec in g.specs for arg in spec.argv])
    machine, notes = describe_machine(), []
    if "vector flags" not in machine:  # benchmarks.harness.machine names them itself on newer trees
        machine += f"\n{vector_line()}"
    points: list[Point] = []
    try:
        for g in groups:
            logger.info("group %s: %s", g.precision, ", ".join(s.name for s in g.specs))
            run_group(g, settings, workloads, levels, args, failures, points)
    except BaseException as e:  # keep what was measured: the tables say it is partial
        notes.append(
            f"**Stopped early** ({type(e).__name__}: {e}); only the points "
            "measured before that are below."
        )
        raise
    finally:
        if points:
            peers = [n for n in (VLLM, LLAMA) if n not in skipped(args)]
            report = Report(
                f"pdserve vs {' and '.join(peers) or 'itself'} (CPU) on {settings.served_name}",
                command,
                machine,
                [*setup, *notes],
                [(w, WORKLOADS[w].describe()) for w in workloads],
                "peers",
                groups=[
                    (g.precision, [s.name for s in g.ours], [s.name for s in g.peers])
                    for g in groups
                ],
                peer_failures=failures,
            )
            write(args.out, report, points)
    return 0 if not failures and all(p.failed == 0 for p in points) else 1


def skipped(args: argparse.Namespace) -> set[str]:
    return {n for n, off in ((VLLM, args.no_vllm), (LLAMA, args.no_llama_cpp)) if off}


def plan(args: argparse.Namespace, s: Settings) -> tuple[list[Group], dict[str, str], list[str]]:
    """Every group's servers; a peer that cannot be installed is a failure, not an error.

    Returns the groups, {peer: why it is missing} and setup lines for the report.
    """
    precisions = _names(args.precisions, PRECISIONS, "--precisions")
    topologies = _names(args.pdserve, list(TOPOLOGIES), "--pdserve")
    quants = [
        PDSERVE_QUANTS[q]
        for q in _names(args.pdserve_quant, list(PDSERVE_QUANTS), "--pdserve-quant")
    ]
    failures: dict[str, str] = {}
    setup: list[str] = []
    by_precision = {p: Group(s.unquantized if p == "F32" else p) for p in precisions}
    # vLLM: the unquantized group (its CPU build has no kernels for these GGUF blocks), and
    # on a CPU with native bfloat16 the Q4_1 group in bfloat16: the faster vLLM there
    # (weights half the bytes), the peer the packed 4-bit rows must beat too.
    native_bf16 = {"avx512_bf16", "amx_bf16"} & set(vector_flags())
    in_bf16 = bool(native_bf16) and not args.no_vllm_bf16 and "Q4_1" in by_precision
    if args.no_vllm or not ("F32" in by_precision or in_bf16):
        setup.append("vLLM: not run" + (" (--no-vllm)" if args.no_vllm else ""))
    else:
        try:
            python = args.venv / "bin" / "python"
            if not args.dry_run:
                python = ensure_vllm(args.venv, args.vllm_spec)
                setup.append(
                    f"vLLM {vllm_version(python)} ({args.vllm_spec}, in {args.venv.name}/)"
                )
            if "F32" in by_precision:
                by_precision["F32"].peers.append(vllm_server(python, s, args.vllm_bind))
            if in_bf16:
                bf16 = dataclasses.replace(s, dtype="bfloat16")
                by_precision["Q4_1"].peers.append(vllm_server(python, bf16, args.vllm_bind))
        except ServerFailed as e:
            failures[VLLM] = f"installing {args.vllm_spec}: {e}"
            setup.append(f"vLLM: {args.vllm_spec} (could not be installed)")
    # llama.cpp: one server per group, on the GGUF of that precision
    ggufs = gguf_files(args, s, precisions, quants, failures, setup)
    if args.no_llama_cpp:
        setup.append(f"{LLAMA}: not run (--no-llama-cpp)")
    elif LLAMA not in failures:
        try:
            build = llama_cpp.LlamaBuild(args.llama_dir, Path(), ())  # a dry run's paths
            if not args.dry_run:
                build = llama_cpp.ensure_llama_cpp(args.llama_dir, args.llama_spec)
                setup.append(f"{LLAMA}: {build.describe()}; `{llama_cpp.version(build)}`")
            for p, g in by_precision.items():
                g.peers.append(llama_server(build, ggufs[p], g.precision, s))
        except ServerFailed as e:
            failures[LLAMA] = f"building {args.llama_spec}: {e}"
            setup.append(f"{LLAMA}: {args.llama_spec} (could not be built)")
    # pdserve: every topology x every variant of a chosen precision
    has_flag = args.dry_run or "--quantization" in launch_help()
    for q in quants:
        for t in topologies if q.precision in by_precision else ():
            gguf = ggufs.get(q.gguf) if q.gguf else None
            by_precision[q.precision].ours.append(pdserve_server(t, q, s, gguf, has_flag))
    return list(by_precision.values()), failures, setup


def run_group(
    g: Group,
    s: Settings,
    workloads: list[str],
    levels: list[int],
    args: argparse.Namespace,
    failures: dict[str, str],
    points: list[Point],
) -> None:
    """Start every server of ``g``, warm each, then measure every point on each in turn,
    appending to ``points`` as they finish.

    A peer that does not start or warm up is left out (its failure goes into
    ``failures``, for the report); a pdserve server that does not is an error.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(s.model)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-peers-"))
    peers = {spec.name for spec in g.peers}
    urls: dict[str, str] = {}
    with ExitStack() as stack:
        for spec in g.specs:
            try:
                urls[spec.name] = stack.enter_context(running(spec, log_dir))
                logger.info("warming up %s", spec.name)
                warm_up(urls[spec.name], s.served_name, tokenizer, max(levels), workloads)
            except (ServerFailed, RuntimeError) as e:
                if spec.name not in peers:
                    raise
                logger.error("%s left out: %s", spec.name, e)
                failures[spec.name] = f"{spec.describe()}\n{e}"
                urls.pop(spec.name, None)
        for i, (w, c) in enumerate((w, c) for w in workloads for c in levels):
            points += _one_point(urls, i, s, tokenizer, w, c, args)
    logger.info("group %s: servers stopped; logs in %s", g.precision, log_dir)


def _one_point(
    urls: dict[str, str],
    i: int,
    s: Settings,
    tokenizer: Any,
    w: str,
    c: int,
    args: argparse.Namespace,
) -> list[Point]:
    """Every server at (``w``, ``c``); who goes first rotates with the point's index ``i``."""
    n = max(args.min_prompts, args.rounds * c)
    names = list(urls)
    k = i % max(1, len(names))
    out = []
    for name in names[k:] + names[:k]:
        p = measure(name, urls[name], s.served_name, tokenizer, w, c, n, args.request_timeout)
        logger.info(
            "%s %s c=%d: %.1f tok/s, TTFT p50 %.0f ms, ITL p50 %.1f ms, %d failed",
            name,
            w,
            c,
            p.figures["output_throughput"],
            p.figures["median_ttft_ms"],
            p.figures["median_itl_ms"],
            p.failed,
        )
        out.append(p)
    return out


def write(out: Path, report: Report, points: list[Point]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(portable(render(report, points)) + "\n")
    doc: dict[str, Any] = {
        "report": asdict(report),
        "points": [asdict(p) for p in points],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out.with_suffix(".json").write_text(portable(json.dumps(doc, indent=1)) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
