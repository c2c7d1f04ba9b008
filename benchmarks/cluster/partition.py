"""What a partition between two hosts does to the streams crossing it: how long they wait
and how they end, for a cut that heals and for one that lasts.

    python -m benchmarks.cluster.partition [--streams 3] [--heal-after 8]
        [--out benchmarks/results/cluster_partition.md]

A head (frontend, prefill) in namespace a and a decode node in namespace b, joined by a
veth (``benchmarks/cluster/netns_pair.py``), serve the tiny test model. Streams of greedy
completions start from inside namespace a; once each has tokens, both ends of the veth
go down. ``heals``: the link comes back after ``--heal-after`` seconds. ``lasts``: it
does not. Each case is a fresh cluster. For every stream: how it ended, its tokens, and
the seconds from the cut to its end. Nothing here is a speed; the times are bounds the
design sets (the head's silence bound, the frontend's resume window), measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster.netns_pair import NetnsLaunch, NetnsPair
from benchmarks.harness.machine import portable, report_head

PORT = 8000
CLUSTER_PORT = 7481
KEY = "cluster-partition-benchmark-key"  # a throwaway cluster inside two namespaces
MAX_TOKENS = 400

# Run inside namespace a: N greedy streams; prints "started" once every stream has a
# token, then one JSON line: per stream its finish reason, tokens and end time (monotonic).
CLIENT = r"""
import asyncio, json, sys, time
import httpx

async def one(client, k, started, out):
    body = {"prompt": f"stream {k}:", "max_tokens": int(sys.argv[3]), "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    rec = {"finish": None, "tokens": 0, "error": None}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                rec["tokens"] += len(choice.get("token_ids") or [])
                rec["finish"] = choice.get("finish_reason") or rec["finish"]
                rec["error"] = choice.get("error") or rec["error"]
                started[k] = True
    except httpx.HTTPError as e:
        rec["error"] = repr(e)
    rec["end"] = time.monotonic()
    out[k] = rec

async def main():
    n = int(sys.argv[2])
    started, out = {}, {}
    async with httpx.AsyncClient(base_url=sys.argv[1], timeout=300) as client:
        tasks = [asyncio.create_task(one(client, k, started, out)) for k in range(n)]
        while len(started) < n:
            await asyncio.sleep(0.01)
        print("started", flush=True)
        await asyncio.wait_for(asyncio.gather(*tasks), 280)
    print(json.dumps([out[k] for k in range(n)]), flush=True)

asyncio.run(main())
"""


def run_case(model: Path, streams: int, heal_after: float | None) -> dict[str, Any]:
    """One cluster, streams started, the link cut (and mended after ``heal_after`` s)."""
    with NetnsPair() as pair:
        advertise = f"{pair.addr('a')}:{CLUSTER_PORT}"
        common = [
            "--model",
            str(model),
            *shlex.split("--device cpu --kv-cache-tokens 8192 --cluster-key"),
            KEY,
        ]
        head = NetnsLaunch(
            pair,
            "a",
            [
                *common,
                *shlex.split("--prefill 1 --decode 0 --remote-decode 1 --advertise"),
                advertise,
                "--node-name",
                "a",
                "--port",
                str(PORT),
            ],
        )
        member = NetnsLaunch(
            pair,
            "b",
            [*common, *shlex.split("--prefill 0 --decode 1 --join"), advertise, "--node-name", "b"],
        )
        try:
            member.wait_for("pdserve node")
            head.wait_for("pdserve is serving")
            client = pair.popen(
                "a",
                [
                    sys.executable,
                    "-c",
                    CLIENT,
                    f"http://127.0.0.1:{PORT}",
                    str(streams),
                    str(MAX_TOKENS),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert client.stdout is not None
            if client.stdout.readline().strip() != "started":
                raise RuntimeError("the streams did not start:\n" + "".join(head.log[-30:]))
            cut = time.monotonic()
            pair.set_link(False)
            if heal_after is not None:
                time.sleep(heal_after)
                pair.set_link(True)
            answer = client.stdout.readline()
            client.wait(30)
        finally:
            pair.set_link(True)
            member.stop()
            head.stop()
    events = [
        line.rstrip()
        for line in head.log + member.log
        if "silent" in line
        or "resumed" in line
        or "request failed" in line
        or "joined" in line
        or "heard again" in line
    ]
    results = json.loads(answer)
    for r in results:
        r["after_cut_s"] = r.pop("end") - cut
    return {"heal_after_s": heal_after, "streams": results, "events": events}


def report(cases: dict[str, dict[str, Any]], command: str, streams: int) -> str:
    lines = [
        *report_head("A partition between two hosts", command),
        f"A head (frontend, prefill) in namespace a, a decode node in namespace b, the "
        f"tiny test model on CPU; {streams} greedy streams of {MAX_TOKENS} tokens from "
        "inside namespace a; once each has a token, both ends of the veth go down.",
        "",
    ]
    for name, case in cases.items():
        heal = case["heal_after_s"]
        what = f"the link is back after {heal:g} s" if heal is not None else "the link stays cut"
        lines += [
            f"## {name}: {what}",
            "",
            "| stream | finish | tokens | seconds from the cut to its end | error |",
            "| ---: | --- | ---: | ---: | --- |",
        ]
        for k, r in enumerate(case["streams"]):
            lines.append(
                f"| {k} | {r['finish']} | {r['tokens']} | {r['after_cut_s']:.1f} | "
                f"{r['error'] or ''} |"
            )
        lines += [
            "",
            "What the nodes logged:",
            "",
            "```",
            *[e.split(" ", 2)[-1] for e in case["events"][-12:]],
            "```",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--heal-after", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from bundled_models import tiny

    model = tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    command = "python -m benchmarks.cluster.partition " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    cases = {
        "heals": run_case(model, args.streams, args.heal_after),
        "lasts": run_case(model, args.streams, None),
    }
    text = report(cases, portable(command.strip()), args.streams)
    print(text)
    if args.out:
        args.out.write_text(portable(text))
        args.out.with_suffix(".json").write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main()
