"""Command line of the serving benchmark; see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.client import ENDPOINTS, RequestConfig
from benchmarks.serving.datasets import (
    SampleRequest,
    mixed_dataset,
    multiturn_dataset,
    random_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from benchmarks.serving.metrics import METRICS, parse_goodput, summarize
from benchmarks.serving.runner import LoadConfig, run_load

logger = logging.getLogger("benchmarks.serving")
SWEEPABLE = {"request-rate": "request_rate", "max-concurrency": "max_concurrency"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__)
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    a("--model", required=True, help="model name sent in each request")
    a("--tokenizer", help="tokenizer dir or name (default: --model)")
    a("--api-key", default=None)
    a(
        "--dataset",
        default="random",
        choices=("random", "sharegpt", "mixed", "multiturn", "shared-prefix"),
    )
    a("--dataset-path", type=Path, help="ShareGPT JSON file (for --dataset sharegpt)")
    a("--sharegpt-output-len", type=int, default=None, help="override reply lengths")
    a("--num-prompts", type=int, default=100)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a(
        "--prefix-len",
        type=int,
        default=1024,
        help="shared-prefix: the shared prefix; multiturn: the system prompt (tokens)",
    )
    a(
        "--turns",
        type=int,
        default=4,
        help="multiturn: turns per conversation "
        "(--num-prompts // turns conversations; --random-input-len tokens per message)",
    )
    a(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos (default: on for random and mixed datasets)",
    )
    a("--request-rate", type=float, default=math.inf, help="req/s; inf = all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson arrivals")
    a("--max-concurrency", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--percentile-metrics", default="ttft,tpot,itl", help=f"of {','.join(METRICS)}")
    a("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    a("--goodput", nargs="*", default=[], metavar="METRIC:MS", help="ttft:MS tpot:MS e2el:MS")
    a("--request-timeout", type=float, default=600.0, help="seconds per request")
    a("--result-file", type=Path, default=None, help="write the result JSON here")
    a("--plot", type=Path, default=None, help="write a PNG here")
    a("--sweep", default=None, help="request-rate=1,2,4 or max-concurrency=1,8,32")
    a("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def load_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    n, seed = args.num_prompts, args.seed
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise SystemExit("--dataset sharegpt needs --dataset-path")
        return sharegpt_dataset(tokenizer, args.dataset_path, n, seed, args.sharegpt_output_len)
    if args.dataset == "mixed":
        return mixed_dataset(tokenizer, n, args.random_input_len, args.random_output_len, seed)
    if args.dataset == "multiturn":
        return multiturn_dataset(
            tokenizer,
            n,
            args.turns,
            args.prefix_len,
            args.random_input_len,
            args.random_output_len,
            seed,
        )
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(
            tokenizer, n, args.prefix_len, args.random_input_len, args.random_output_len, seed
        )
    return random_dataset(
        tokenizer, n, args.random_input_len, args.random_output_len, args.random_range_ratio, seed
    )


def sweep_points(args: argparse.Namespace) -> list[LoadConfig]:
    base = dict(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
    )
    if args.sweep is None:
        return [LoadConfig(**base)]
    name, _, values = args.sweep.partition("=")
    if name not in SWEEPABLE or not values:
        raise SystemExit(f"--sweep must be one of {sorted(SWEEPABLE)}=v1,v2,...")
    cast = float if name == "request-rate" else int
    return [LoadConfig(**{**base, SWEEPABLE[name]: cast(v)}) for v in values.split(",")]


def print_summary(result: dict[str, Any], metrics: list[str], percentiles: list[float]) -> None:
    lines = [
        f"{'Successful requests:':<40}{result['completed']}",
        f"{'Failed requests:':<40}{result['failed']}",
        f"{'Benchmark duration (s):':<40}{result['duration']:.2f}",
        f"{'Request throughput (req/s):':<40}{result['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:.2f}",
        f"{'Prompt tokens cached (reported):':<40}{result['prefix_cache_hit_rate']:.3f}",
    ]
    if result["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{result['request_goodput']:.2f}")
    for m in metrics:
        for stat in ["mean", "median", *(f"p{p:g}" for p in percentiles)]:
            lines.append(f"{f'{stat} {m.upper()} (ms):':<40}{result[f'{stat}_{m}_ms']:.2f}")
    for error, count in result["errors_summary"].items():
        lines.append(f"FAILED x{count}: {error}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(metrics) - set(METRICS):
        raise SystemExit(f"--percentile-metrics: unknown {sorted(unknown)}")
    percentiles = sorted({float(p) for p in args.metric_percentiles.split(",")} | {99.0})
    slos = parse_goodput(args.goodput)
    requests = load_requests(args, tokenizer)
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset != "sharegpt"
    cfg = RequestConfig(
        args.base_url, args.endpoint, args.model, ignore_eos, args.api_key, args.request_timeout
    )
    results = []
    for load in sweep_points(args):
        logger.info(
            "run: rate=%s burstiness=%s max_concurrency=%s",
            load.request_rate,
            load.burstiness,
            load.max_concurrency,
        )
        records, duration = asyncio.run(run_load(requests, cfg, load, tokenizer, args.disable_tqdm))
        result = summarize(records, duration, percentiles, slos)
        result.update(
            date=time.strftime("%Y%m%d-%H%M%S"),
            backend="openai",
            model_id=args.model,
            tokenizer_id=args.tokenizer or args.model,
            endpoint=args.endpoint,
            dataset=args.dataset,
            num_prompts=len(requests),
            request_rate=load.request_rate,
            burstiness=load.burstiness,
            max_concurrency=load.max_concurrency,
            machine=platform.platform(),
            command=" ".join(sys.argv),
        )
        print_summary(result, metrics, percentiles)
        results.append(result)
    write_outputs(args, results)
    failed = sum(r["failed"] for r in results)
    if failed:
        print(f"{failed} request(s) failed; see the errors above", file=sys.stderr)
    return 1 if failed else 0


def write_outputs(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    if args.result_file is not None:
        payload: Any = results[0] if len(results) == 1 else results
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: inf request rates are written as the string "inf": JSON has no infinity.
        args.result_file.write_text(json.dumps(_finite(payload), indent=1))
    if args.plot is not None:
        from benchmarks.serving.plot import plot_run, plot_sweep

        if len(results) == 1:
            plot_run(results[0], args.plot)
        else:
            name = SWEEPABLE[args.sweep.partition("=")[0]]
            plot_sweep(results, args.plot, name)


def _finite(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


if __name__ == "__main__":
    sys.exit(main())
