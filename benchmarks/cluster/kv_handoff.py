"""KV handoff time between two stand-in hosts (NIXL, UCX over TCP across a veth between
two network namespaces) against the same-host ``shm`` copy, with the link's own
throughput measured in the same run.

    python -m benchmarks.cluster.kv_handoff [--tokens 256 1024 4096] [--repeats 7]
        [--out benchmarks/results/kv_handoff.md]

The KV is the default model's (SmolLM2-135M: 30 layers, 3 KV heads of 64, bfloat16 as
served quantized, blocks of 16 tokens): 23 KiB a token, 5.6 MiB for 256 tokens. Block
ids on both sides are scattered, as an allocator hands them out after some churn, so a
handoff is many descriptors, not one range.

Three processes: this one (the ``shm`` baseline, the same copy a decode worker runs on a
host: ``ShmReceiver.fetch`` between two shared segments), a ``source`` in namespace ``a``
holding a prefill-shaped pool registered with NIXL (``NixlExporter``), and a ``reader``
in namespace ``b`` (``NixlReceiver``) that times, per prompt length, one handoff READ
with its release notification, and the link: one READ of the whole pool, whose blocks
are adjacent on both sides and merge into one contiguous range. The handle goes from
source to reader over their pipes in length-prefixed frames, never pickled. The veth's byte counters are
read around the reader's run, so the figures say how many bytes crossed the link.

Target (issue #22): a handoff moves KV at >= 0.8x of the link's measured throughput.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch

from benchmarks.cluster.nixl_link import read_frame, read_json, write_frame, write_json
from benchmarks.harness.machine import describe, portable, report_head
from transport.kv import pool_view
from transport.kv_backends import ShmReceiver
from transport.segment import Segment
from wire.kv_layout import KVLayout

BLOCK = 16
LINK_BLOCKS = (
    1024  # 360 MiB pool: room for the longest prompt's blocks scattered, and the link READ
)


def layout(num_blocks: int = LINK_BLOCKS) -> KVLayout:
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=30,
        block_size=BLOCK,
        num_kv_heads=3,
        head_dim=64,
        dtype="bfloat16",
    )


def scattered(tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """Source and destination block ids of one handoff: distinct, in no order."""
    n = -(-tokens // BLOCK)
    rng = random.Random(seed)
    return rng.sample(range(LINK_BLOCKS), n), rng.sample(range(LINK_BLOCKS), n)


def _median_s(fn: Any, repeats: int) -> float:
    fn()  # warm: first READ sets up the UCX endpoint, first copy faults the pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _protocol_out() -> IO[bytes]:
    """The original stdout for our frames; fd 1 then goes to stderr, where NIXL and UCX
    print their own lines."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return out


def run_source() -> None:
    """Namespace a: a prefill pool on NIXL. Sends its handle, serves until stdin closes,
    then sends how many releases arrived as notifications."""
    from transport.kv_nixl import NixlExporter

    out = _protocol_out()
    lay = layout()
    pool = torch.randint(-100, 100, lay.shape, dtype=torch.int16).view(lay.torch_dtype)
    exporter = NixlExporter(pool, lay, f"handoff-source-{os.getpid()}")
    exporter.serve_reads(True)
    write_frame(out, exporter.handle())
    sys.stdin.buffer.read()  # the reader is done when the parent closes our stdin
    releases: list[object] = []
    for _ in range(100):  # bounded: the last notifications trail their READs by little
        releases += exporter.releases()
        time.sleep(0.01)
    write_json(out, {"releases": len(releases)})
    exporter.close()


def run_reader(tokens: list[int], repeats: int) -> None:
    """Namespace b: READs from the source; sends one JSON frame of figures."""
    from transport.kv_nixl import NixlReceiver, release_notification

    out = _protocol_out()
    lay = layout()
    pool = torch.zeros(lay.shape, dtype=lay.torch_dtype)
    receiver = NixlReceiver(pool, lay, f"handoff-reader-{os.getpid()}", timeout_s=120)
    receiver.open(0, read_frame(sys.stdin.buffer))
    every = list(range(LINK_BLOCKS))
    link_s = _median_s(lambda: receiver.fetch(0, every, every), repeats)
    figures: dict[str, Any] = {"link_s": link_s, "link_bytes": lay.nbytes, "handoffs": {}}
    rid = iter(range(1_000_000))
    for n in tokens:
        src, dst = scattered(n, seed=n)
        figures["handoffs"][n] = _median_s(
            lambda src=src, dst=dst: receiver.fetch(0, src, dst, release_notification(next(rid))),
            repeats,
        )
    # Every block READ must hold the source's bytes: compare a sample against the link
    # READ's copy, which read the same source blocks.
    src, dst = scattered(tokens[-1], seed=tokens[-1])
    staged = pool[dst].clone()
    receiver.fetch(0, every, every)
    if not torch.equal(staged.view(torch.int16), pool[src].view(torch.int16)):
        raise SystemExit("a handoff READ's bytes differ from the source's")
    figures["bytes_read"], figures["reads"] = receiver.bytes_read, receiver.reads
    write_json(out, figures)
    receiver.close()


def shm_baseline(tokens: list[int], repeats: int) -> dict[int, float]:
    """The same-host copy: a decode worker's ``ShmReceiver.fetch`` from a prefill pool."""
    lay = layout()
    segs = [Segment.create(f"bench.kv{side}", lay.nbytes, reserve=False) for side in "ab"]
    try:
        src, dst = (pool_view(s, lay) for s in segs)
        src.view(torch.int16).random_(-100, 100)
        receiver = ShmReceiver({0: src}, dst)
        out = {}
        for n in tokens:
            s, d = scattered(n, seed=n)
            out[n] = _median_s(lambda s=s, d=d: receiver.fetch(0, s, d), repeats)
        return out
    finally:
        for seg in segs:
            seg.close()


def measure(tokens: list[int], repeats: int) -> dict[str, Any]:
    from benchmarks.cluster.netns_pair import NetnsPair, Side

    me = [sys.executable, "-m", "benchmarks.cluster.kv_handoff"]
    result: dict[str, Any] = {"shm_s": shm_baseline(tokens, repeats)}
    with NetnsPair() as pair:

        def env(side: Side) -> dict[str, str]:
            return {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": pair.dev(side)}

        source = pair.popen(
            "a", [*me, "source"], env=env("a"), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert source.stdout is not None and source.stdin is not None
        handle = read_frame(source.stdout)
        rx0, _ = pair.link_bytes("b")
        frame = len(handle).to_bytes(4, "big") + handle
        reader = subprocess.run(
            pair.argv(
                "b", [*me, "reader", "--tokens", *map(str, tokens), "--repeats", str(repeats)]
            ),
            timeout=600,
            input=frame,
            env=env("b"),
            capture_output=True,
        )
        rx1, _ = pair.link_bytes("b")
        if reader.returncode != 0:
            err = reader.stderr[-3000:].decode(errors="replace")
            raise RuntimeError(f"reader failed:\n{err}")
        source.stdin.close()
        tail = read_json(source.stdout)
        source.wait(30)
    figures = read_json(io.BytesIO(reader.stdout))
    result.update(figures, veth_rx_bytes=rx1 - rx0, releases=tail["releases"])
    return result


def report(result: dict[str, Any], tokens: list[int], command: str) -> str:
    lay = layout()
    link_gbs = result["link_bytes"] / result["link_s"] / 1e9
    lines = [
        *report_head("KV handoff: NIXL across two network namespaces vs same-host shm", command),
        f"Link (UCX over TCP on a veth, one {result['link_bytes'] / 2**20:.0f} MiB READ): "
        f"**{link_gbs:.2f} GB/s** (median of the run's READs).",
        "",
        "| prompt tokens | KV MiB | shm copy ms | NIXL handoff ms | handoff GB/s | vs link |"
        " shm / NIXL |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in tokens:
        nbytes = -(-n // BLOCK) * lay.block_nbytes
        nixl_s, shm_s = result["handoffs"][str(n)], result["shm_s"][n]
        gbs = nbytes / nixl_s / 1e9
        lines.append(
            f"| {n} | {nbytes / 2**20:.1f} | {shm_s * 1e3:.2f} | {nixl_s * 1e3:.1f} | "
            f"{gbs:.2f} | {gbs / link_gbs:.2f}x | {shm_s / nixl_s:.3f}x |"
        )
    lines += [
        "",
        f"Bytes: the reader's NIXL backend counted {result['bytes_read'] / 2**20:.0f} MiB in "
        f"{result['reads']} READs; the veth of namespace b received "
        f"{result['veth_rx_bytes'] / 2**20:.0f} MiB meanwhile (TCP and UCX headers on top); "
        f"the source got {result['releases']} release notifications.",
        "",
        "Block ids are scattered on both sides (one descriptor per block); the link READ "
        "reads every block of the pool in order, which NIXL merges into one range.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=["source", "reader"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.role == "source":
        return run_source()
    if args.role == "reader":
        return run_reader(args.tokens, args.repeats)
    if max(args.tokens) > LINK_BLOCKS * BLOCK:
        parser.error(f"--tokens above {LINK_BLOCKS * BLOCK} do not fit the benchmark pool")
    command = "python -m benchmarks.cluster.kv_handoff " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = measure(args.tokens, args.repeats)
    text = report(result, args.tokens, portable(command.strip()))
    print(text)
    if args.out:
        args.out.write_text(portable(text))
        result["machine"] = describe()
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
