"""One greedy 128-token stream, served, against transformers ``generate`` in-process.

    python -m benchmarks.serving.single_stream [--model DIR] [--tokens 128] [--runs 3]

For each server layout, the thread count its decoding worker runs with (``launch`` gives
each engine worker ``cores // workers`` threads) is also given to transformers: a
``1P+1D`` server decodes on one thread, a ``--colocated 1`` server on every core. Per
layout: transformers ``generate`` (greedy, exactly ``--tokens`` new tokens, float32, the
same prompt) timed in this process with no server running, then the server launched and
one streamed ``/v1/completions`` request timed from send to its last token. Reported:
tokens/s over the whole request (the first token included) and decode tokens/s after the
first token, median of ``--runs``, and pdserve / transformers. Writes
``benchmarks/results/single_stream.md``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.harness.machine import describe as describe_machine
from benchmarks.harness.servers import launch
from benchmarks.harness.sse import sse_chunks

RESULTS = Path(__file__).parents[1] / "results" / "single_stream.md"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
LAYOUTS = {"1P+1D": shlex.split("--prefill 1 --decode 1"), "co-located": ["--colocated", "1"]}


@dataclass
class Timing:
    total_s: float  # send (or generate call) to last token
    first_s: float  # to the first token

    def rates(self, tokens: int) -> tuple[float, float]:
        return tokens / self.total_s, (tokens - 1) / (self.total_s - self.first_s)


def threads_for(layout: str) -> int:
    workers = 2 if layout == "1P+1D" else 1
    return max(1, (os.cpu_count() or 1) // workers)


def hf_runs(model_dir: Path, threads: int, tokens: int, runs: int) -> list[Timing]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(PROMPT)])
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": tok.eos_token_id}

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    gen(8)  # warm-up
    out = []
    for _ in range(runs):
        first = gen(1)  # the prompt's forward and one token: the first-token time
        out.append(Timing(gen(tokens), first))
    return out


def served_runs(model_dir: Path, layout: str, tokens: int, runs: int) -> list[Timing]:
    args = [
        "--model",
        str(model_dir),
        *shlex.split("--device cpu --dtype float32"),
        *LAYOUTS[layout],
    ]
    proc, url = launch(args)
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            body = {
                "model": model,
                "prompt": PROMPT,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            _stream(c, {**body, "max_tokens": 8})  # warm-up
            return [_stream(c, body, tokens) for _ in range(runs)]
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its whole tree
        proc.wait(60)


def _stream(c: httpx.Client, body: dict[str, object], expect: int | None = None) -> Timing:
    t0 = time.perf_counter()
    first = last = None
    usage = None
    with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r.iter_lines()):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first if first is not None else last
    assert first is not None and last is not None and usage is not None
    if expect is not None:
        assert usage["completion_tokens"] == expect, usage
    return Timing(last - t0, first - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    from bundled_models.default_model import resolve_model

    model_dir = resolve_model(a.model)
    rows = []
    for layout in a.layouts.split(","):
        threads = threads_for(layout)
        hf = hf_runs(model_dir, threads, a.tokens, a.runs)
        served = served_runs(model_dir, layout, a.tokens, a.runs)
        hf_rate = [statistics.median(t.rates(a.tokens)[k] for t in hf) for k in (0, 1)]
        pd_rate = [statistics.median(t.rates(a.tokens)[k] for t in served) for k in (0, 1)]
        rows.append(
            f"| {layout} | {threads} | {hf_rate[0]:.1f} | {pd_rate[0]:.1f} | "
            f"**{pd_rate[0] / hf_rate[0]:.2f}x** | {hf_rate[1]:.1f} | {pd_rate[1]:.1f} | "
            f"{pd_rate[1] / hf_rate[1]:.2f}x |"
        )
    command = "python -m benchmarks.serving.single_stream " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            "# One greedy stream: pdserve served vs transformers generate in-process",
            "",
            f"Command: `{command.strip()}`",
            "",
            "```",
            describe_machine(),
            "```",
            "",
            f"Model `{model_dir.name}`, float32, {a.tokens} new tokens (EOS ignored), prompt "
            f"{PROMPT!r}; median of {a.runs} runs. pdserve: one streamed `/v1/completions` "
            "request, timed at the client from send to last token; transformers: "
            "`generate` in this process, with the thread count of pdserve's decoding worker.",
            "",
            "| pdserve layout | threads | transformers tok/s | pdserve tok/s | pdserve / "
            "transformers | transformers decode tok/s | pdserve decode tok/s | ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
            "",
        ]
    )
    print(text)
    if not a.no_write:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
