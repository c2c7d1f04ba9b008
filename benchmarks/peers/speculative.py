"""Speculative decoding served: pdserve with and without n-gram speculation, one run.

    python -m benchmarks.peers.speculative [--model DIR] [--tokens 256] [--runs 1] [--seeds 1]

Two servers of the same layout (1 prefill, 1 decode worker, CPU), without and with
``--speculative-config`` (n-gram, k = 4), run side by side, and every workload goes to
one then the other, alternating which goes first (ABBA). Each takes:
* single streams, one request at a time: input-grounded work (a summary that quotes a
  ~1.5k-token article, a whole-file code edit, extraction of the article's figures) and
  open chat, at temperature 0 and 0.7 (seeded), ``--tokens`` output tokens: TTFT, TPOT
  (time per output token after the first), ITL p50/p90 (gaps between streamed chunks),
  and the acceptance the decode worker's /metrics report (accepted / draft tokens). A
  greedy workload's figures are the best of ``--runs``; a sampled one's pool ``--seeds``
  seeds (the text a seed's path copies varies, and with it what speculation gains);
* the 8-stream workload: 24 chat requests of ~256 prompt tokens and 64 output tokens,
  8 at a time: output tokens per second.
Ratios are with / without, from the same run. The load average is recorded with the
figures (the host may be shared). On a shared host, pin the run to one core
(``taskset -c 1 python -m benchmarks.peers.speculative``): the workers then run one thread each
and never lend each other a core another process holds (an OpenMP thread waiting on a
descheduled one slows a step many times over). Writes ``benchmarks/results/speculative.md``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.cli import model_parser
from benchmarks.harness.machine import portable, report_head
from benchmarks.harness.servers import ServerSpec, launch, running
from benchmarks.harness.sse import sse_chunks
from benchmarks.peers import llama_cpp
from bundled_models.default_model import bundled_gguf, default_model_dir

RESULTS = Path(__file__).parents[1] / "results" / "speculative.md"
PDSERVE = ("off", "on")
LLAMA = ("llama.cpp off", "llama.cpp on")
# llama.cpp's prompt-lookup kind, as its speculative-decoding guide shows it for the
# server: the tokens that followed the last occurrence of the current 12-gram (defaults).
LLAMA_NGRAM = tuple(shlex.split("--spec-type ngram-simple --spec-draft-n-max 64"))
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
ARTICLE_FILE = Path(__file__).parents[1] / "data" / "perplexity.txt"
CODE_FILE = Path(__file__).parents[2] / "engine" / "kv" / "sequence.py"
CHAT = [
    "Tell me a story about a dragon who learns to bake bread.",
    "What are some good habits for staying healthy in winter?",
]


def article(chars: int = 6500) -> str:
    """~1.5k tokens of prose (the project's own docs: public text, in the repository)."""
    return ARTICLE_FILE.read_text()[:chars]


def single_prompts() -> dict[str, str]:
    text, code = article(), CODE_FILE.read_text()
    return {
        "summary (quotes)": "Summarise the text below, quoting its key sentences word for "
        f"word.\n\n{text}",
        "code edit": "Rename the method append_token to push_token everywhere in this file "
        f"and return the whole file.\n\n{code}",
        "extraction": f"List every file path mentioned in the text below, one per line.\n\n{text}",
        **{f"chat {i + 1}": q for i, q in enumerate(CHAT)},
    }


@dataclass
class Stream:
    ttft: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    tokens: int = 0
    drafted: int = 0  # llama.cpp's own count (its final chunk's ``timings``)
    accepted: int = 0

    @property
    def tpot(self) -> float:
        return (self.times[-1] - self.times[0]) / max(1, self.tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def pooled(streams: list[Stream]) -> Stream:
    """Several streams as one: their gaps back to back (TPOT = all decode time over all
    tokens after each first), the median TTFT, summed draft counts."""
    out = Stream(ttft=statistics.median(s.ttft for s in streams))
    t = 0.0
    out.times.append(t)
    for s in streams:
        for g in s.gaps:
            t += g
            out.times.append(t)
    out.tokens = 1 + sum(max(0, s.tokens - 1) for s in streams)
    out.drafted = sum(s.drafted for s in streams)
    out.accepted = sum(s.accepted for s in streams)
    return out


def stream(url: str, content: str, max_tokens: int, temperature: float, seed: int = 7) -> Stream:
    body = {
        "model": served_model(url),
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    s, t0 = Stream(), time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r.iter_lines()):
            if chunk.get("usage"):
                s.tokens = chunk["usage"]["completion_tokens"]
            if timings := chunk.get("timings"):  # llama.cpp's server
                s.tokens = s.tokens or timings.get("predicted_n", 0)
                s.drafted = timings.get("draft_n", 0)
                s.accepted = timings.get("draft_n_accepted", 0)
            if any(c["delta"].get("content") for c in chunk["choices"]):
                now = time.monotonic()
                if not s.times:
                    s.ttft = now - t0
                s.times.append(now)
    return s


_MODELS: dict[str, str] = {}


def served_model(url: str) -> str:
    if url not in _MODELS:
        _MODELS[url] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return _MODELS[url]


def speculation_counts(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) the decode workers report so far."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_total\{{[^}}]*\}} (\S+)", text, re.M))

    return total("pdserve_spec_decode_num_draft_tokens"), total(
        "pdserve_spec_decode_num_accepted_tokens"
    )


def measure(
    urls: dict[str, str], tokens: int, runs: int, seeds: int = 1
) -> dict[str, dict[str, object]]:
    """Every workload on both servers, alternating which goes first (ABBA), so load that
    drifts on a shared host falls on both alike. Greedy workloads: the best of ``runs``.
    Sampled ones: ``seeds`` seeds, pooled (one seed's path through the text is one draw
    of how much of it the model copies)."""
    out: dict[str, dict[str, object]] = {k: {"singles": {}} for k in urls}
    order = list(urls)
    for url in urls.values():
        stream(url, "Hello", 8, 0.0)  # warm up
    for temp in (0.0, 0.7):
        for name, content in single_prompts().items():
            for key in order:
                url, best = urls[key], None
                before = speculation_counts(url) if key in PDSERVE else (0.0, 0.0)
                drafted = accepted = 0.0
                if temp > 0 and seeds > 1:
                    best = pooled([stream(url, content, tokens, temp, 7 + i) for i in range(seeds)])
                    drafted, accepted = best.drafted, best.accepted
                else:
                    for _ in range(runs):
                        s = stream(url, content, tokens, temp)
                        drafted, accepted = drafted + s.drafted, accepted + s.accepted
                        best = s if best is None or s.tpot < best.tpot else best
                if key in PDSERVE:
                    after = speculation_counts(url)
                    drafted, accepted = after[0] - before[0], after[1] - before[1]
                rate = accepted / drafted if drafted else float("nan")
                singles = out[key]["singles"]
                assert best is not None and isinstance(singles, dict)
                singles[f"{name}, T={temp}"] = (best, rate)
            order.reverse()
    rates: dict[str, list[float]] = {k: [] for k in PDSERVE}
    pd = [k for k in order if k in PDSERVE]  # llama.cpp runs one slot: single streams only
    for key in [*pd, *reversed(pd)]:
        rates[key].append(eight_streams(urls[key]))
    for key in urls:
        out[key]["eight"] = statistics.mean(rates[key]) if key in rates else float("nan")
        out[key]["load"] = os.getloadavg()
    return out


def eight_streams(url: str) -> float:
    """24 requests of ~256 prompt tokens and 64 output tokens, 8 at a time: tokens/s."""
    words = article(20000).split()
    prompts = [
        " ".join(words[i * 150 : i * 150 + 190]) + "\n\nContinue this text." for i in range(24)
    ]
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: stream(url, p, 64, 0.7), prompts))
    return sum(s.tokens for s in results) / (time.monotonic() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(
    command: str,
    off: dict[str, object],
    on: dict[str, object],
    speculative_config: str = NGRAM_CONFIG,
) -> str:
    lines = report_head("Speculative decoding (n-gram) on CPU", command)
    cores = sorted(os.sched_getaffinity(0))
    lines += [
        f"CPU affinity of the run (its servers inherit it): cores {cores} of {os.cpu_count()}.",
        "",
    ]
    lines += [
        f"Load average (1, 5, 15 min) at the end of the run: {on['load']}. Both servers "
        "run side by side; each workload goes to one then the other, alternating which "
        "goes first; the 8-stream workload runs ABBA (its figure: the mean of two).",
        "",
        f"pdserve 1P+1D, `--speculative-config '{speculative_config}'` against none; single "
        "streams (one request at a time), ms:",
        "",
        "| workload | TTFT off | TTFT on | TPOT off | TPOT on | TPOT off/on | ITL p50 off "
        "| ITL p50 on | ITL p90 off | ITL p90 on | acceptance |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    s_off, s_on = off["singles"], on["singles"]
    assert isinstance(s_off, dict) and isinstance(s_on, dict)
    for name, (a, _) in s_off.items():
        b, rate = s_on[name]
        ms = [1000 * x for x in (a.ttft, b.ttft, a.tpot, b.tpot)]
        itl = [1000 * pct(s.gaps, q) for q in (0.5, 0.9) for s in (a, b)]
        lines.append(
            f"| {name} | {ms[0]:.0f} | {ms[1]:.0f} | {ms[2]:.1f} | {ms[3]:.1f} | "
            f"{a.tpot / b.tpot:.2f}x | {itl[0]:.1f} | {itl[1]:.1f} | {itl[2]:.1f} | "
            f"{itl[3]:.1f} | {rate:.2f} |"
        )
    e_off, e_on = off["eight"], on["eight"]
    assert isinstance(e_off, float) and isinstance(e_on, float)
    lines += [
        "",
        "8 streams (24 requests, ~256 prompt / 64 output tokens, T=0.7), output "
        f"tokens/s: without {e_off:.1f}, with {e_on:.1f} ({e_on / e_off:.2f}x).",
        "",
    ]
    return "\n".join(lines)


def llama_report(
    describe: str,
    pd: tuple[dict[str, object], dict[str, object]],
    ll: tuple[dict[str, object], dict[str, object]],
) -> str:
    """llama.cpp's gain from its n-gram speculation beside pdserve's, workload by workload."""
    lines = [
        f"llama.cpp's server ({describe}) on the same GGUF, one slot, one thread, without "
        f"and with `{' '.join(LLAMA_NGRAM)}`, in the same run (its workloads interleaved "
        "with pdserve's). Single streams, TPOT ms; gain = TPOT off / on:",
        "",
        "| workload | llama.cpp off | llama.cpp on | llama.cpp gain | its acceptance "
        "| pdserve off | pdserve on | pdserve gain | pdserve gain >= llama.cpp's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    p_off, p_on = (d["singles"] for d in pd)
    l_off, l_on = (d["singles"] for d in ll)
    assert all(isinstance(x, dict) for x in (p_off, p_on, l_off, l_on))
    assert isinstance(p_off, dict) and isinstance(p_on, dict)
    assert isinstance(l_off, dict) and isinstance(l_on, dict)
    for name, (la, _) in l_off.items():
        lb, lrate = l_on[name]
        pa, pb = p_off[name][0], p_on[name][0]
        lg, pg = la.tpot / lb.tpot, pa.tpot / pb.tpot
        lines.append(
            f"| {name} | {1000 * la.tpot:.1f} | {1000 * lb.tpot:.1f} | {lg:.2f}x | "
            f"{lrate:.2f} | {1000 * pa.tpot:.1f} | {1000 * pb.tpot:.1f} | {pg:.2f}x | "
            f"{'yes' if pg >= lg else 'no'} |"
        )
    return "\n".join([*lines, ""])


def llama_specs(served: str, log_dir: Path) -> tuple[list[ServerSpec], str]:
    """llama.cpp's server without and with n-gram speculation on the GGUF pdserve's
    default model is converted from (built here once: see benchmarks/peers/llama_cpp.py)."""
    build = llama_cpp.ensure_llama_cpp()
    argv = llama_cpp.server_argv(
        build, bundled_gguf(), threads=1, parallel=1, max_model_len=4096, alias=served
    )
    specs = [ServerSpec(LLAMA[0], argv), ServerSpec(LLAMA[1], [*argv, *LLAMA_NGRAM])]
    return specs, f"{build.describe()}, {llama_cpp.version(build)}"


def main() -> None:
    ap = model_parser(__doc__, RESULTS)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=1, help="greedy workloads: the best of N")
    ap.add_argument("--seeds", type=int, default=1, help="sampled workloads: N seeds, pooled")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument(
        "--speculative-config", default=NGRAM_CONFIG, help="pdserve's, for the 'on' server"
    )
    a = ap.parse_args()
    model = a.model or default_model_dir()
    base = [
        "--model",
        str(model),
        *shlex.split(
            "--prefill 1 --decode 1 --device cpu --kv-cache-tokens 32768 --max-model-len 4096"
        ),
    ]
    procs = {}
    with contextlib.ExitStack() as stack:
        try:
            on_flags = ["--speculative-config", a.speculative_config]
            for key, extra in zip(PDSERVE, ([], on_flags), strict=True):
                procs[key] = launch([*base, *extra])
            urls = {k: url for k, (_, url) in procs.items()}
            describe = ""
            if not a.no_llama_cpp and a.model is None:
                log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                specs, describe = llama_specs(served_model(urls["off"]), log_dir)
                for server in specs:
                    urls[server.name] = stack.enter_context(running(server, log_dir))
            figures = measure(urls, a.tokens, a.runs, a.seeds)
        finally:
            for proc, _ in procs.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    off, on = figures["off"], figures["on"]
    flags = " --no-llama-cpp" if a.no_llama_cpp else ""
    if a.speculative_config != NGRAM_CONFIG:
        flags += f" --speculative-config '{a.speculative_config}'"
    cores = sorted(os.sched_getaffinity(0))
    pin = f"taskset -c {','.join(map(str, cores))} " if len(cores) < (os.cpu_count() or 0) else ""
    command = portable(
        f"{pin}python -m benchmarks.peers.speculative --tokens {a.tokens} --runs {a.runs} "
        f"--seeds {a.seeds}{flags}"
    )
    text = report(command, off, on, a.speculative_config)
    if describe:
        text += "\n" + llama_report(describe, (off, on), (figures[LLAMA[0]], figures[LLAMA[1]]))
    a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
