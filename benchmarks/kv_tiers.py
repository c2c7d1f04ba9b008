"""KV tiers beyond the pool: turn-k TTFT from recompute, tier 2, tier 3, and tier 3 after a
restart; where loading beats recomputing; the cost on a workload without reuse; tier
bandwidth against memcpy and the disk's own rate, all in one run (one process, the
in-process engine, the default SmolLM2 checkpoint on CPU).

    python -m benchmarks.kv_tiers [--lengths 1024 2048 4096] [--out benchmarks/results/kv_tiers.md]

Each conversation's turn k is its history (``L`` tokens) plus 32 new tokens; before turn
k the history is pushed out of a deliberately small pool by other conversations, so the
pool never holds it and the history's KV comes from the tier under test (or is
recomputed, tiers off). TTFT is the time to the first token of turn k (prefill of what
is not loaded + one sample). "After restart": a new engine with a new, empty tier 2 and
the same directory, with the files dropped from the page cache first (posix_fadvise), so
the disk is read.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.machine import load_average, report_head
from checkpoints.default_model import resolve_model
from colocated.llm import LLM
from engine.config import EngineConfig, ModelConfig
from engine.kv.kv_cache import pool_layout
from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.persister import Persister
from wire.params import SamplingParams

BS = 16
NEW = 32
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class Rig:
    """One engine, optionally with a fresh tier 2 and a tier-3 directory."""

    def __init__(self, model: Path, pool_tokens: int, tier_gib: float, disk: Path | None) -> None:
        mc = ModelConfig.from_pretrained(model)
        kw: dict[str, Any] = {}
        self.host: HostStore | None = None
        if tier_gib:
            nb = pool_layout(mc, 1, BS, torch.bfloat16).block_nbytes
            g = Geometry.for_budget(int(tier_gib * (1 << 30)), BS, nb)
            fd, buf = create_segment(g.offsets[3])
            HostStore.format(buf, g)
            self.host = HostStore(fd, buf)
            kw = {
                "kv_offload_fd": fd,
                "kv_offload_nbytes": g.offsets[3],
                "kv_offload_dir": None if disk is None else str(disk),
            }
        self.llm = LLM(
            EngineConfig(
                model=str(model),
                dtype="bfloat16",
                num_kv_blocks=pool_tokens // BS,
                max_model_len=8192,
                **kw,
            )
        )
        self.llm.generate([list(range(2000, 2040))], FIRST)  # warm-up, below a block's reuse

    def ttft(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.generate([prompt], FIRST)
        return time.perf_counter() - t0

    def persist(self) -> None:
        tiers = self.llm.runner.kv.tiers
        assert tiers is not None and tiers.disk is not None
        Persister(tiers.host, tiers.disk, 64 << 30, 0).stop(flush=True)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1000, 40_000, n).tolist()


def _drop_page_cache(root: Path) -> None:
    for p in root.rglob("*.kvb"):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def turn_ttft(model: Path, length: int, disk: Path) -> dict[str, float]:
    """Turn-k TTFT (seconds) with an ``length``-token history, from each source.

    Recompute after eviction is the turn run on an engine that never saw the history.
    """
    rng = np.random.default_rng(length)
    history, filler = _tokens(rng, length), [_tokens(rng, length) for _ in range(2)]
    turn = history + _tokens(rng, NEW)
    pool = length + 512  # holds one conversation, not three
    out = {"recompute": Rig(model, pool, 0.0, None).ttft(turn)}
    rig = Rig(model, pool, 2.0, disk)
    for p in (history, *filler):
        rig.ttft(p)
    rig.persist()
    out["tier 2"] = rig.ttft(turn)
    out["tier 3"] = Rig(model, pool, 2.0, disk).ttft(turn)  # a new, empty tier 2
    _drop_page_cache(disk)
    out["tier 3 after restart"] = Rig(model, pool, 2.0, disk).ttft(turn)
    return out


def no_reuse_cost(model: Path, n: int, length: int, disk: Path) -> dict[str, float]:
    """Median seconds per request over ``n`` distinct prompts: tiers off, tier 2, tiers
    2+3 (the persister thread running, as in a launched server). The three engines take
    turns request by request, so a change of the machine's load hits all three alike."""
    rng = np.random.default_rng(7)
    prompts = [_tokens(rng, length) for _ in range(n)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rigs = {
        "off": Rig(model, 8192, 0.0, None),
        "tier 2": Rig(model, 8192, 1.0, None),
        "tiers 2+3": Rig(model, 8192, 1.0, disk),
    }
    tiers = rigs["tiers 2+3"].llm.runner.kv.tiers
    assert tiers is not None and tiers.disk is not None
    pers = Persister(tiers.host, tiers.disk, 64 << 30, 0)
    pers.start()
    times: dict[str, list[float]] = {name: [] for name in rigs}
    for i, p in enumerate(prompts):
        order = list(rigs)[i % 3 :] + list(rigs)[: i % 3]
        for name in order:
            t0 = time.perf_counter()
            rigs[name].llm.generate([p], params)
            times[name].append(time.perf_counter() - t0)
    pers.stop(flush=True)
    out = {name: statistics.median(t) for name, t in times.items()}
    host = rigs["tier 2"].host
    assert host is not None  # the tiers' own time per request, whatever the machine's load
    out["tier 2 store time"] = host.counters()["host_store_ns"] / 1e9 / n
    return out


def bandwidth(model: Path, disk: Path) -> dict[str, float]:
    """GB/s: tier-2 and tier-3 loads (from their counters, a 4k history), memcpy of the
    same bytes, and the disk's own sequential write (fsync) and cold read."""
    length = 4096
    rng = np.random.default_rng(3)
    history = _tokens(rng, length)
    rig = Rig(model, length + 512, 2.0, disk)
    rig.ttft(history)
    for other in (_tokens(rng, length), _tokens(rng, length)):
        rig.ttft(other)
    rig.persist()
    assert rig.host is not None
    before = rig.host.counters()
    rig.ttft(history + _tokens(rng, NEW))
    c = rig.host.counters()
    t2 = (c["host_bytes_out"] - before["host_bytes_out"]) / max(
        1, c["host_load_ns"] - before["host_load_ns"]
    )
    _drop_page_cache(disk)
    cold = Rig(model, length + 512, 2.0, disk)
    assert cold.host is not None
    cold.ttft(history + _tokens(rng, NEW))
    c = cold.host.counters()
    t3 = c["disk_bytes_read"] / max(1, c["disk_load_ns"])
    nb = c["disk_bytes_read"]
    src, dst = np.ones(nb, np.uint8), np.zeros(nb, np.uint8)
    np.copyto(dst, src)  # pages touched: memcpy's rate, not the page faults'
    t0 = time.perf_counter_ns()
    for _ in range(5):
        np.copyto(dst, src)
    memcpy = 5 * nb / (time.perf_counter_ns() - t0)
    probe = disk / "probe.bin"
    data = os.urandom(256 << 20)
    t0 = time.perf_counter_ns()
    with probe.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write = len(data) / (time.perf_counter_ns() - t0)
    fd = os.open(probe, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter_ns()
    while os.read(fd, 1 << 22):
        pass
    read = len(data) / (time.perf_counter_ns() - t0)
    os.close(fd)
    probe.unlink()
    return {
        "tier 2 load": t2,
        "memcpy": memcpy,
        "tier 3 load (cold)": t3,
        "disk read (cold)": read,
        "disk write (fsync)": write,
    }


def report(
    ttft: dict[int, dict[str, float]],
    cost: dict[str, float],
    bw: dict[str, float],
    command: str,
    load_before: str,
) -> str:
    lines = report_head("KV tiers beyond the pool", command)
    lines += [f"Load average at the start: {load_before}; at the end: {load_average()}.", ""]
    lines += ["## Turn-k time to first token (seconds), history pushed out of the pool", ""]
    cols = ["recompute", "tier 2", "tier 3", "tier 3 after restart"]
    lines += [
        "| history tokens | " + " | ".join(cols) + " | tier 2 speed-up | "
        "tier 3 after restart speed-up |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for n, row in sorted(ttft.items()):
        vals = " | ".join(f"{row[c]:.3f}" for c in cols)
        lines.append(
            f"| {n} | {vals} | {row['recompute'] / row['tier 2']:.1f}x | "
            f"{row['recompute'] / row['tier 3 after restart']:.1f}x |"
        )
    wins = [n for n, row in sorted(ttft.items()) if row["tier 2"] < row["recompute"]]
    lines += [
        "",
        f"Loading from tier 2 beats recomputing from {min(wins) if wins else 'no'} "
        "history tokens on (the shortest length measured where it does).",
        "",
    ]
    lines += [
        "## No reuse: median seconds per request (distinct 1024-token prompts, 16 tokens)",
        "",
        "| tiers | seconds | cost vs off |",
        "|---|---|---|",
    ]
    direct = cost.pop("tier 2 store time")
    for name, s in cost.items():
        lines.append(f"| {name} | {s:.3f} | {100 * (s / cost['off'] - 1):+.1f} % |")
    lines += [
        "",
        f"Time spent storing blocks into tier 2 (its counters): {direct * 1e3:.1f} ms "
        f"per request, {100 * direct / cost['off']:.2f} % of a request with tiers off.",
    ]
    lines += [
        "",
        "## Bandwidth (GB/s), measured in the same run",
        "",
        "| path | GB/s |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} |" for k, v in bw.items()]
    lines += [
        "",
        f"Tier 2 moves {100 * bw['tier 2 load'] / bw['memcpy']:.0f} % of memcpy; "
        f"tier 3 reads {100 * bw['tier 3 load (cold)'] / bw['disk read (cold)']:.0f} % of "
        "the disk's cold sequential read.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--no-reuse-requests", type=int, default=9)
    ap.add_argument("--dir", type=Path, default=None, help="tier-3 directory (a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_tiers.md"))
    args = ap.parse_args(argv)
    load_before = load_average()
    torch.manual_seed(0)
    model = resolve_model(None)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        ttft = {n: turn_ttft(model, n, root / f"t{n}") for n in args.lengths}
        cost = no_reuse_cost(model, args.no_reuse_requests, 1024, root / "noreuse")
        bw = bandwidth(model, root / "bw")
    command = "python -m benchmarks.kv_tiers " + shlex.join(sys.argv[1:])
    text = report(ttft, cost, bw, command, load_before)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
