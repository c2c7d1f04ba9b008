"""Prefix caching on a launched 2P/2D server: TTFT with caching on vs off, hit rates vs the
ideal, cache-aware vs least-load routing - all in one run, one server at a time.

For each dataset (``benchmarks.serving``'s ``shared-prefix`` and ``multiturn``) three
servers run the same requests at the same arrival rate:
    on        prefix caching, cache-aware routing (the defaults)
    off       --no-enable-prefix-caching (least-load routing, its default)
    on-ll     prefix caching, --router-policy least-load
Figures: client TTFT percentiles; the prefill workers' hit rate (tokens found cached /
tokens looked up, from ``/metrics`` before and after); the decode workers' (handed-off KV
tokens not copied); how the prompt tokens split over the two prefill workers; and the
ideal hit rate: each prompt's longest block-aligned prefix shared with any earlier prompt
of the run (capped at its length - 1, as prefill recomputes the last token), as one cache
of unbounded size would find it. Two prefill workers must each compute a shared prefix
once, so their ideal is slightly lower.

    python -m benchmarks.serving.prefix_cache [--quick]
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.cli import quick_parser
from benchmarks.harness.machine import machine_block
from benchmarks.harness.servers import launch
from benchmarks.serving.__main__ import main as serving_main
from bundled_models import tiny
from engine.kv.block_allocator import block_hashes

logger = logging.getLogger("benchmarks.serving.prefix_cache")
RESULTS = Path(__file__).parents[1] / "results" / "prefix_cache.md"
BS = 16
# NOTE: 512-token prefill chunks keep every engine step well under the router's 1 s
# staleness bound on a loaded 2-core machine; with 2048-token chunks of long prompts both
# prefill workers can be mid-step at once and a request is refused 503 (no live worker).
SERVER = shlex.split(
    "--prefill 2 --decode 2 --detokenizers 1 --device cpu --kv-cache-tokens 65536 --max-model-len 4096 --chunked-prefill-size 512 --log-level warning"
)
CONFIGS = {
    "on": [],
    "off": ["--no-enable-prefix-caching"],
    "on-ll": ["--router-policy", "least-load"],
}
# (dataset, endpoint, benchmarks.serving flags). shared-prefix: 80 % of each prompt is
# the shared prefix; multiturn: 16 conversations of 4 turns on one system prompt.
DATASETS = {
    "shared-prefix": (
        "/v1/completions",
        shlex.split(
            "--num-prompts 32 --prefix-len 3072 --random-input-len 768 --random-output-len 16 --request-rate 0.6"
        ),
    ),
    "multiturn": (
        "/v1/chat/completions",
        shlex.split(
            "--num-prompts 64 --turns 4 --prefix-len 1024 --random-input-len 128 --random-output-len 64 --request-rate 4"
        ),
    ),
}
_SAMPLE = re.compile(r'^(pdserve_\w+)\{index="(\d+)",node="[^"]*",role="(\w+)"\} (\S+)$')


def scrape(url: str) -> dict[tuple[str, str, int], float]:
    """(metric, role, index) -> value of every per-worker sample of ``/metrics``."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if m := _SAMPLE.match(line):
            out[(m[1], m[3], int(m[2]))] = float(m[4])
    return out


def _delta(b: dict[Any, float], a: dict[Any, float], metric: str, role: str) -> dict[int, float]:
    return {i: v - b.get((m, r, i), 0.0) for (m, r, i), v in a.items() if (m, r) == (metric, role)}


def hit_rate(b: dict[Any, float], a: dict[Any, float], role: str) -> float:
    hits = sum(_delta(b, a, "pdserve_prefix_cache_hit_tokens", role).values())
    queried = sum(_delta(b, a, "pdserve_prefix_cache_queried_tokens", role).values())
    return hits / queried if queried else 0.0


def ideal_hit_rate(prompts: list[list[int]]) -> float:
    """Tokens one unbounded cache would reuse / prompt tokens, in the requests' order."""
    seen: set[int] = set()
    hit = total = 0
    for ids in prompts:
        hashes = block_hashes(ids, BS)
        n = 0
        while n < min(len(hashes), (len(ids) - 1) // BS) and hashes[n] in seen:
            n += 1
        hit, total = hit + n * BS, total + len(ids)
        seen.update(hashes)
    return hit / total if total else 0.0


def _prompt_ids(tokenizer: Any, dataset: str, extra: list[str]) -> list[list[int]]:
    """The token ids the server computes for each request, in the dataset's order."""
    from benchmarks.serving.__main__ import load_requests, parse_args

    args = parse_args(["--model", "m", "--dataset", dataset, *extra])
    reqs = load_requests(args, tokenizer)
    if dataset != "multiturn":
        return [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    out = []
    for r in (
        reqs
    ):  # rendered, then encoded, as the frontend does (frontend/api/openai/chat_completions.py)
        chat = [{"role": role, "content": text} for role, text in r.messages or ()]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def run_one(config: str, dataset: str, tokenizer_dir: Path, out_dir: Path) -> dict[str, Any]:
    endpoint, extra = DATASETS[dataset]
    proc, url = launch([*SERVER, *CONFIGS[config]])
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        before = scrape(url)
        result_file = out_dir / f"prefix_cache_{dataset}_{config}.json"
        argv = [
            "--base-url",
            url,
            "--model",
            model,
            "--tokenizer",
            str(tokenizer_dir),
            "--endpoint",
            endpoint,
            "--dataset",
            dataset,
            *extra,
            *shlex.split("--seed 0 --metric-percentiles 50,90,99 --disable-tqdm --result-file"),
            str(result_file),
        ]
        rc = serving_main(argv)
        after = scrape(url)
    finally:
        proc.terminate()
        proc.wait(60)
    res = json.loads(result_file.read_text())
    return {
        "config": config,
        "dataset": dataset,
        "rc": rc,
        "failed": res["failed"],
        "p50_ttft_ms": res["median_ttft_ms"],
        "p90_ttft_ms": res["p90_ttft_ms"],
        "p99_ttft_ms": res["p99_ttft_ms"],
        "p50_tpot_ms": res["median_tpot_ms"],
        "duration_s": res["duration"],
        "reported_cached": res["prefix_cache_hit_rate"],
        "prefill_hit_rate": hit_rate(before, after, "prefill"),
        "decode_hit_rate": hit_rate(before, after, "decode"),
        "prefill_tokens": _delta(before, after, "pdserve_router_assigned_tokens_total", "prefill"),
    }


def report(rows: list[dict[str, Any]], ideal: dict[str, float], command: str) -> str:
    lines = [
        "# Prefix caching: TTFT on vs off, hit rates, cache-aware vs least-load routing",
        "",
        f"Command: `{command}`",
        "",
        f"Servers (one at a time): `launch {' '.join(SERVER)}` plus "
        + ", ".join(f"{k}: `{' '.join(v) or '(defaults)'}`" for k, v in CONFIGS.items()),
        "",
        "Datasets (`python -m benchmarks.serving` flags):",
        "",
    ]
    for name, (endpoint, extra) in DATASETS.items():
        lines.append(f"- `{name}` on `{endpoint}`: `{' '.join(extra)}`")
    lines += [
        "",
        "| dataset | server | p50 TTFT ms | p90 | p99 | p50 TPOT ms | prefill hit "
        "rate | ideal | decode hit rate | prefill tokens per worker |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        split = " / ".join(f"{v:.0f}" for _, v in sorted(r["prefill_tokens"].items()))
        lines.append(
            f"| {r['dataset']} | {r['config']} | {r['p50_ttft_ms']:.1f} | "
            f"{r['p90_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['p50_tpot_ms']:.1f} | "
            f"{r['prefill_hit_rate']:.3f} | {ideal[r['dataset']]:.3f} | "
            f"{r['decode_hit_rate']:.3f} | {split} |"
        )
    lines += ["", "Ratios (same run):", ""]
    by = {(r["dataset"], r["config"]): r for r in rows}
    for name in DATASETS:
        on, off, ll = by[(name, "on")], by[(name, "off")], by[(name, "on-ll")]
        lines.append(
            f"- `{name}`: p50 TTFT off / on = **{off['p50_ttft_ms'] / on['p50_ttft_ms']:.2f}x**"
            f"; prefill hit rate on = {on['prefill_hit_rate']:.3f} of ideal "
            f"{ideal[name]:.3f} ({on['prefill_hit_rate'] / ideal[name]:.0%}); "
            f"cache-aware vs least-load: hit rate {on['prefill_hit_rate']:.3f} vs "
            f"{ll['prefill_hit_rate']:.3f}, p50 TTFT {on['p50_ttft_ms']:.1f} vs "
            f"{ll['p50_ttft_ms']:.1f} ms"
        )
    lines += ["", *machine_block()]
    return "\n".join(lines)


def main() -> int:
    parser = quick_parser(__doc__, "16 requests per dataset")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.quick:
        for _, extra in DATASETS.values():
            extra[extra.index("--num-prompts") + 1] = "16"
    from transformers import AutoTokenizer

    tokenizer_dir = tiny.tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ideal = {
        name: ideal_hit_rate(_prompt_ids(tokenizer, name, extra))
        for name, (_, extra) in DATASETS.items()
    }
    out_dir = RESULTS.parent if not args.quick else Path("/tmp")
    rows = []
    started = time.monotonic()
    for dataset in DATASETS:
        for config in CONFIGS:
            logger.info("%s on %s", dataset, config)
            rows.append(run_one(config, dataset, tokenizer_dir, out_dir))
            logger.info("%s", rows[-1])
    command = "python -m benchmarks.serving.prefix_cache " + " ".join(sys.argv[1:])
    text = report(rows, ideal, command.strip())
    text += f"Wall time of the run: {time.monotonic() - started:.0f} s.\n"
    if not args.quick:
        RESULTS.write_text(text)
    sys.stdout.write(text)
    return 1 if any(r["failed"] or r["rc"] for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
