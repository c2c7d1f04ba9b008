"""TTFT and ITL of serving across two stand-in hosts against the same workers on one host,
at the same load, in one run.

    python -m benchmarks.cluster.serving [--num-prompts 24] [--concurrency 4]
        [--input-len 256] [--output-len 64] [--rounds 2]
        [--out benchmarks/results/cluster_serving.md]

Two setups, each a fresh server on the default model (SmolLM2-135M-Instruct, packed, on
the CPU), both with one prefill and one decode worker:

    one host   ``launch --prefill 1 --decode 1`` in namespace a (nothing in b)
    two nodes  head ``launch --prefill 1 --decode 0 --remote-decode 1 --advertise ...``
               in namespace a; member ``launch --prefill 0 --decode 1 --join ...`` in b

The two namespaces are joined by a veth (``benchmarks/cluster/netns_pair.py``): in the two-node
setup every handoff's KV crosses it by NIXL (UCX over TCP, ``UCX_TLS=tcp``), the control
records (request, first token, text) by the CURVE-authenticated cluster link through the
two gateways. Both setups have the same worker counts, model, KV budget, load and
machine: the one host has all its cores; in the two-node setup each stand-in host has
its own half of them (``NetnsPair.cores``), as two real hosts would, and its core lease
counts only those. So the figures hold the same hardware split two ways, not a second
host's added compute; and a veth is a kernel copy rather than a wire.

(Without the split, each node leased every core to its own workers and the two nodes'
thread pools fought over them: prefill steps of 256 tokens took up to 6.3 s instead of
0.1-0.4 s, and requests met a 503 "no live prefill worker" once a step outlasted the
router's 5 s staleness bound.)

The load is the project's own harness, ``python -m benchmarks.serving`` (``--dataset
random``, ``--max-concurrency``), run inside namespace a against the head's loopback, as
a client on the head's host would. Each server first answers one warm-up round (one
request per stream, other prompts), then the measured run. ``--rounds`` repeats the pair
of setups in ABBA order (one host, two nodes, two nodes, one host, ...) so a drift in the
machine's load falls on both alike; TTFT and ITL percentiles are over every request and
every gap of all rounds together, output tok/s is all output tokens over all measured
time. The veth's byte counters are read around each measured run: the two-node runs must
move at least the prompts' KV (bfloat16, as the packed default serves it); the one-host
runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cluster.netns_pair import NetnsLaunch, NetnsPair, Side
from benchmarks.harness.machine import describe, portable, report_head

PORT = 8000  # the head's HTTP port, on namespace a's own loopback
CLUSTER_PORT = 7481
# A key for this run's own throwaway cluster inside two private namespaces.
KEY = "cluster-serving-benchmark-key"
SETUPS = ("one host", "two nodes")
LAUNCH = (
    *shlex.split("--device cpu --kv-cache-tokens 16384 --max-model-len 2048 --port"),
    str(PORT),
)


def node(pair: NetnsPair, side: Side, args: list[str], own_cores: bool = True) -> NetnsLaunch:
    """One ``launch`` with this benchmark's settings inside a namespace."""
    return NetnsLaunch(pair, side, [*LAUNCH, *args], own_cores)


def start(pair: NetnsPair, setup: str) -> list[NetnsLaunch]:
    """The setup's nodes, serving; the head is first."""
    if setup == "one host":
        nodes = [node(pair, "a", shlex.split("--prefill 1 --decode 1"), own_cores=False)]
    else:
        advertise = f"{pair.addr('a')}:{CLUSTER_PORT}"
        nodes = [
            node(
                pair,
                "a",
                [
                    *shlex.split("--prefill 1 --decode 0 --remote-decode 1 --advertise"),
                    advertise,
                    "--cluster-key",
                    KEY,
                    "--node-name",
                    "a",
                ],
            ),
            node(
                pair,
                "b",
                [
                    *shlex.split("--prefill 0 --decode 1 --join"),
                    advertise,
                    "--cluster-key",
                    KEY,
                    "--node-name",
                    "b0",
                ],
            ),
        ]
    try:
        for member in nodes[1:]:
            member.wait_for("pdserve node")
        nodes[0].wait_for("pdserve is serving")
    except BaseException:
        stop(nodes)
        raise
    return nodes


def stop(nodes: list[NetnsLaunch]) -> None:
    for node in reversed(nodes):  # members first, as an operator would take a cluster down
        node.stop()


def harness(
    pair: NetnsPair,
    args: argparse.Namespace,
    model: Path,
    prompts: int,
    seed: int,
    result_file: Path,
) -> dict[str, Any]:
    """One ``benchmarks.serving`` run inside namespace a; its result JSON."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serving",
        "--base-url",
        f"http://127.0.0.1:{PORT}",
        "--model",
        model.name,
        "--tokenizer",
        str(model),
        "--dataset",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        str(seed),
        *shlex.split("--metric-percentiles 50,90 --disable-tqdm --result-file"),
        str(result_file),
    ]
    done = pair.run("a", cmd, timeout=600)
    if not result_file.exists():  # failed requests still write a result; anything else not
        raise RuntimeError(
            f"benchmarks.serving failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return json.loads(result_file.read_text())


def one_run(
    pair: NetnsPair, args: argparse.Namespace, model: Path, setup: str, tmp: Path
) -> dict[str, Any]:
    """Start ``setup``, warm it, measure, stop it. Returns the harness's raw series plus
    the veth bytes of the measured part and the nodes' logs' evidence of where KV went."""
    t0 = time.monotonic()
    nodes = start(pair, setup)
    ready_s = time.monotonic() - t0
    try:
        harness(pair, args, model, args.concurrency, 1000 + args.seed, tmp / "warm.json")
        rx0, tx0 = pair.link_bytes("b")
        res = harness(pair, args, model, args.num_prompts, args.seed, tmp / "run.json")
        rx1, tx1 = pair.link_bytes("b")
    finally:
        stop(nodes)
    mapped = any("mapped prefill 0's KV pool" in line for n in nodes[1:] for line in n.log)
    warnings = [
        line.rstrip() for n in nodes for line in n.log if "WARNING" in line or "ERROR" in line
    ]
    return {
        "setup": setup,
        "ready_s": ready_s,
        "duration": res["duration"],
        "completed": res["completed"],
        "total_input_tokens": res["total_input_tokens"],
        "total_output_tokens": res["total_output_tokens"],
        "ttfts": ok(res, "ttfts"),
        "itls": ok(res, "itls"),
        "failed": res["failed"],
        "errors_summary": res["errors_summary"],
        "p50_ttft_ms": res["p50_ttft_ms"],
        "p50_itl_ms": res["p50_itl_ms"],
        "output_throughput": res["output_throughput"],
        "veth_b_rx_bytes": rx1 - rx0,
        "veth_b_tx_bytes": tx1 - tx0,
        "member_mapped_prefill_pool": mapped,
        "warnings": warnings[-50:],
    }


def ok(res: dict[str, Any], key: str) -> list[Any]:
    """``res[key]`` of the requests that succeeded (failed ones are reported, not timed)."""
    return [v for v, err in zip(res[key], res["errors"], strict=True) if not err]


def pooled(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Percentiles over every request (TTFT) and every inter-token gap (ITL) of ``runs``."""
    ttft = np.array([t for r in runs for t in r["ttfts"]]) * 1e3
    itl = np.array([g for r in runs for gaps in r["itls"] for g in gaps]) * 1e3
    out_tokens = sum(r["total_output_tokens"] for r in runs)
    return {
        "requests": float(len(ttft)),
        "failed": float(sum(r["failed"] for r in runs)),
        "itl_gaps": float(len(itl)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "itl_p50_ms": float(np.percentile(itl, 50)),
        "itl_p90_ms": float(np.percentile(itl, 90)),
        "output_tok_s": out_tokens / sum(r["duration"] for r in runs),
        "veth_b_rx_bytes": float(sum(r["veth_b_rx_bytes"] for r in runs)),
        "veth_b_tx_bytes": float(sum(r["veth_b_tx_bytes"] for r in runs)),
    }


def kv_bytes_per_prompt(model: Path, tokens: int) -> int:
    """Bytes of one prompt's KV as the packed default serves it (bfloat16, 16-token blocks)."""
    import torch

    from engine.config import ModelConfig
    from engine.kv.kv_cache import pool_layout

    blocks = -(-tokens // 16)
    return (
        blocks * pool_layout(ModelConfig.from_pretrained(model), 1, 16, torch.bfloat16).block_nbytes
    )


def measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    order = [s for k in range(args.rounds) for s in (SETUPS if k % 2 == 0 else SETUPS[::-1])]
    runs = []
    with NetnsPair() as pair, tempfile.TemporaryDirectory(prefix="cluster-serving-") as tmp:
        for setup in order:
            print(f"-- {setup}", file=sys.stderr, flush=True)
            run = one_run(pair, args, model, setup, Path(tmp))
            print(
                f"   TTFT p50 {run['p50_ttft_ms']:.1f} ms, ITL p50 {run['p50_itl_ms']:.1f} ms,"
                f" {run['output_throughput']:.1f} tok/s, veth {run['veth_b_rx_bytes']} B",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
        cores = {"all": sorted(os.sched_getaffinity(0)), "a": pair.cores("a"), "b": pair.cores("b")}
    return {
        "order": order,
        "runs": runs,
        "cores": cores,
        "pooled": {s: pooled([r for r in runs if r["setup"] == s]) for s in SETUPS},
        "kv_bytes_per_prompt": kv_bytes_per_prompt(model, args.input_len),
    }


def report(result: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    one, two = (result["pooled"][s] for s in SETUPS)
    pair_cores = result["cores"]
    rows = [
        ("TTFT p50 ms", "ttft_p50_ms"),
        ("TTFT p90 ms", "ttft_p90_ms"),
        ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p90 ms", "itl_p90_ms"),
        ("output tok/s", "output_tok_s"),
    ]
    lines = [
        *report_head("Serving across two nodes vs one host", command),
        f"Load: `python -m benchmarks.serving --dataset random --random-input-len "
        f"{args.input_len} --random-output-len {args.output_len} --num-prompts "
        f"{args.num_prompts} --max-concurrency {args.concurrency}` inside namespace a, after "
        f"a warm-up of {args.concurrency} requests per server; {args.rounds} rounds in the "
        f"order {', '.join(result['order'])}. Model: the default (SmolLM2-135M-Instruct, "
        "packed Q4_1), CPU, `--kv-cache-tokens 16384 --max-model-len 2048`.",
        "",
        "- one host: `launch --prefill 1 --decode 1` in namespace a",
        "- two nodes: `launch --prefill 1 --decode 0 --remote-decode 1 --advertise A:7481` "
        "in a, `launch --prefill 0 --decode 1 --join A:7481` in b; KV by NIXL (UCX over TCP "
        "on the veth)",
        "",
        f"Percentiles over all {one['requests']:.0f} / {two['requests']:.0f} requests and "
        f"{one['itl_gaps']:.0f} / {two['itl_gaps']:.0f} inter-token gaps of each setup's "
        "rounds together.",
        "",
        "| | one host | two nodes | two nodes / one host |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, key in rows:
        lines.append(f"| {label} | {one[key]:.1f} | {two[key]:.1f} | {two[key] / one[key]:.2f}x |")
    lines += [
        "",
        "Per run (the harness's own medians):",
        "",
        "| # | setup | ready s | TTFT p50 ms | ITL p50 ms | output tok/s | veth b rx MiB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(result["runs"], 1):
        lines.append(
            f"| {i} | {r['setup']} | {r['ready_s']:.1f} | {r['p50_ttft_ms']:.1f} | "
            f"{r['p50_itl_ms']:.1f} | {r['output_throughput']:.1f} | "
            f"{r['veth_b_rx_bytes'] / 2**20:.1f} |"
        )
    for r in result["runs"]:
        if r["failed"]:
            lines += [
                "",
                f"**{r['setup']}: {r['failed']} of {r['failed'] + r['completed']} "
                f"requests failed** (left out of the figures): `{r['errors_summary']}`",
            ]
    kv = result["kv_bytes_per_prompt"] * two["requests"]
    lines += [
        "",
        f"Veth, measured runs only: the two-node runs moved "
        f"{two['veth_b_rx_bytes'] / 2**20:.1f} MiB into b and {two['veth_b_tx_bytes'] / 2**20:.1f}"
        f" MiB out of it ({two['veth_b_rx_bytes'] / two['requests'] / 2**20:.2f} MiB in per "
        f"request); the prompts' KV is {kv / 2**20:.1f} MiB "
        f"({result['kv_bytes_per_prompt'] / 2**20:.2f} MiB per {args.input_len}-token prompt "
        f"in bfloat16). The one-host runs: {one['veth_b_rx_bytes'] / 2**20:.2f} MiB in, "
        f"{one['veth_b_tx_bytes'] / 2**20:.2f} MiB out.",
        "",
        f"Cores: the one host has all {len(pair_cores['all'])} "
        f"(`{pair_cores['all']}`); in the two-node setup the head runs on "
        f"`{pair_cores['a']}` and the member on `{pair_cores['b']}`, each node's core "
        "lease counting its own. Same hardware, split two ways: the two-node prefill worker "
        "has half the cores the one-host one can lease, and the decode worker has its own "
        "that prefill never takes. The load generator runs unpinned in namespace a in both. "
        "The ratio is the cost and the gain of that split plus the cluster path (gateways, "
        "cluster link, NIXL READ over TCP), not a second host's added compute.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA: one host, two nodes, ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from bundled_models.default_model import default_model_dir

    model = default_model_dir()  # converted (once, cached) before anything is timed
    command = "python -m benchmarks.cluster.serving " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = measure(args, model)
    text = report(result, args, portable(command.strip()))
    print(text)
    if args.out:
        args.out.write_text(portable(text))
        result["machine"] = describe()
        result["command"] = portable(command.strip())
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
