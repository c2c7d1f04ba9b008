"""Many LoRA adapters served batched: throughput with 1, 4 and 8 distinct adapters against
the base alone, on one server, in one run.

    python -m benchmarks.lora [--model DIR] [--targets q_proj,k_proj,v_proj,o_proj] [--rank 16]

One server (1 prefill, 1 decode worker, CPU, ``--enable-lora --max-loras 8``) serves
the 8-stream workload (24 chat requests of ~256 prompt tokens and 64 output tokens, 8 at
a time, T=0.7 seeded; ``benchmarks/speculative.py``'s) four ways: every request on the
base model, and requests spread round-robin over 1, 4 and 8 distinct adapters of rank
``--rank`` (random weights, made with peft for the served model). The conditions run in
ABBA order (base, 1, 4, 8, 8, 4, 1, base) and each figure is the mean of its two runs, so
load that drifts on a shared host falls on all alike. Ratios are to the base, from the
same run. Writes ``benchmarks/results/lora.md``.

vLLM's CPU build with LoRA is not run here (see the results page).
"""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.cli import model_parser
from benchmarks.machine import portable, report_head
from benchmarks.soak import launch
from benchmarks.speculative import article
from benchmarks.sse import sse_chunks
from checkpoints.default_model import default_model_dir
from checkpoints.lora import make_adapter

RESULTS = Path(__file__).parent / "results" / "lora.md"
CONDITIONS = (0, 1, 4, 8)  # distinct adapters; 0: the base alone


def stream_tokens(url: str, model: str, content: str) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": 64,
        "temperature": 0.7,
        "seed": 7,
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


def eight_streams(url: str, models: list[str]) -> float:
    """24 requests, 8 at a time, request i on ``models[i % len(models)]``: tokens/s."""
    words = article(20000).split()
    prompts = [
        " ".join(words[i * 150 : i * 150 + 190]) + "\n\nContinue this text." for i in range(24)
    ]
    jobs = [(models[i % len(models)], p) for i, p in enumerate(prompts)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        tokens = sum(pool.map(lambda j: stream_tokens(url, *j), jobs))
    return tokens / (time.monotonic() - t0)


def report(
    command: str, rates: dict[int, float], load: tuple[float, ...], rank: int, targets: str
) -> str:
    base = rates[0]
    lines = report_head("LoRA adapters: 8 streams with 1, 4 and 8 distinct adapters", command)
    lines += [
        f"8 streams (24 requests, ~256 prompt / 64 output tokens, T=0.7), adapters of rank "
        f"{rank} on {targets}, round-robin over the requests; one server, conditions run "
        "ABBA, each figure the mean of its two runs.",
        "",
        "| requests on | output tok/s | vs base |",
        "| --- | ---: | ---: |",
    ]
    for k in CONDITIONS:
        name = "the base alone" if k == 0 else f"{k} adapter{'s' * (k > 1)}"
        lines.append(f"| {name} | {rates[k]:.1f} | {rates[k] / base:.2f}x |")
    lines += [
        "",
        f"Load average after the run: {', '.join(f'{x:.1f}' for x in load)}.",
        "",
        "vLLM's CPU build with LoRA: not measured in this run.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = model_parser(__doc__, RESULTS)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    a = ap.parse_args()
    model = a.model or default_model_dir()
    targets = tuple(a.targets.split(","))
    root = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    paths = [make_adapter(model, root / f"a{i}", a.rank, targets, seed=i + 1) for i in range(8)]
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    proc, url = launch(
        [
            "--model",
            str(model),
            *shlex.split(
                "--prefill 1 --decode 1 --device cpu --kv-cache-tokens 32768 --max-model-len 4096 --enable-lora --max-loras 8 --max-lora-rank"
            ),
            str(a.rank),
            "--lora-modules",
            *modules,
        ]
    )
    try:
        base_name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        names = {0: [base_name], **{k: [f"a{i}" for i in range(k)] for k in CONDITIONS[1:]}}
        for i in range(8):  # warm up: every adapter resident in both workers
            stream_tokens(url, f"a{i}", "Hello")
        runs: dict[int, list[float]] = {k: [] for k in CONDITIONS}
        for k in [*CONDITIONS, *reversed(CONDITIONS)]:
            runs[k].append(eight_streams(url, names[k]))
            print(f"{k} adapters: {runs[k][-1]:.1f} tok/s", flush=True)
        rates = {k: statistics.mean(v) for k, v in runs.items()}
        load = os.getloadavg()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    command = portable(f"python -m benchmarks.lora --rank {a.rank} --targets {a.targets}")
    text = report(command, rates, load, a.rank, a.targets)
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
