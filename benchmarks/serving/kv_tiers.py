"""KV tiers beyond the pool: turn-k TTFT from recompute, tier 2, tier 3, and tier 3 after a
restart; where loading beats recomputing; the cost on a workload without reuse; tier
bandwidth against memcpy and the disk's own rate, all in one run (one process, the
in-process engine, the default SmolLM2 checkpoint on CPU).

    python -m benchmarks.serving.kv_tiers [--lengths 1024 2048 4096] [--out benchmarks/results/kv_tiers.md]

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness.machine import load_average, report_head
from bundled_models.default_model import resolve_model
from colocated.llm import LLM
from engine.config import EngineConfig, ModelConfig
from engine.kv.kv_cache import pool_layout
from engine.kv.tiers.disk_load import READERS
from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.persister import Persister
from wire.params import SamplingParams

BS = 16
NEW = 32
_PER_ROUND = 2  # no-reuse prompts per engine per round
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
        Persister(tiers.host, tiers.disk.root, 64 << 30, 0).stop(flush=True)


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


def no_reuse_cost(
    model: Path, rounds: int, per_round: int, length: int, disk: Path
) -> dict[str, list[float]]:
    """Seconds per round of ``per_round`` distinct prompts (16 output tokens each), for
    tiers off, tier 2 (1 GiB, the default) and tiers 2+3 (the persister thread running,
    as in a launched server). Every round each engine runs the same new prompts, in an
    order rotated round by round, so a change of the machine's load between rounds hits
    all three alike: the ratio to "off" is taken within a round."""
    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rigs = {
        "off": Rig(model, 8192, 0.0, None),
        "tier 2": Rig(model, 8192, 1.0, None),
        "tiers 2+3": Rig(model, 8192, 1.0, disk),
    }
    tiers = rigs["tiers 2+3"].llm.runner.kv.tiers
    assert tiers is not None and tiers.disk is not None
    pers = Persister(tiers.host, tiers.disk.root, 64 << 30, 0)
    pers.start()
    times: dict[str, list[float]] = {name: [] for name in rigs}
    for r in range(rounds):
        prompts = [_tokens(rng, length) for _ in range(per_round)]
        order = list(rigs)[r % 3 :] + list(rigs)[: r % 3]
        for name in order:
            t0 = time.perf_counter()
            for p in prompts:
                rigs[name].llm.generate([p], params)
            times[name].append(time.perf_counter() - t0)
    pers.stop(flush=True)
    host = rigs["tier 2"].host
    assert host is not None  # the tiers' own time per request, whatever the machine's load
    times["tier 2 store time"] = [host.counters()["host_store_ns"] / 1e9 / (rounds * per_round)]
    return times


def _cold_read(path: Path) -> float:
    """GB/s of one sequential read of ``path`` from the disk (its pages dropped first)."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter_ns()
    n = 0
    while chunk := os.read(fd, 1 << 22):
        n += len(chunk)
    os.close(fd)
    return n / (time.perf_counter_ns() - t0)


def _files_read(root: Path, in_flight: int = 1) -> float:
    """GB/s of reading every block file under ``root`` once (cold), one after another or
    ``in_flight`` at a time: the disk's own rate for the requests tier 3 makes."""
    _drop_page_cache(root)
    paths = sorted(root.rglob("*.kvb"))

    def read(p: Path) -> int:
        n, fd = 0, os.open(p, os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 22):
                n += len(chunk)
        finally:
            os.close(fd)
        return n

    t0 = time.perf_counter_ns()
    with ThreadPoolExecutor(in_flight) as pool:
        n = sum(pool.map(read, paths))
    return n / (time.perf_counter_ns() - t0)


def bandwidth(model: Path, disk: Path, rounds: int) -> dict[str, list[float]]:
    """GB/s per round: tier-2 and tier-3 loads (from their counters, a 4k history; tier 3
    from a restarted engine, the files dropped from the page cache), memcpy of the same
    bytes, the disk's own cold sequential read of one file as large as the history's
    files together, and the same files read raw one after another. Rounds alternate
    the tier-3 load and the disk's reads, so both see the same machine."""
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
    nb = c["host_bytes_out"] - before["host_bytes_out"]
    src, dst = np.ones(nb, np.uint8), np.zeros(nb, np.uint8)
    np.copyto(dst, src)  # pages touched: memcpy's rate, not the page faults'
    t0 = time.perf_counter_ns()
    for _ in range(5):
        np.copyto(dst, src)
    memcpy = 5 * nb / (time.perf_counter_ns() - t0)
    del rig
    probe = disk / "probe.bin"
    with probe.open("wb") as f:  # as many bytes as the tier-3 files of the run together
        data = os.urandom(3 * nb)
        t0 = time.perf_counter_ns()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        write = len(data) / (time.perf_counter_ns() - t0)
    out: dict[str, list[float]] = {
        "tier 2 load": [t2],
        "memcpy": [memcpy],
        "disk write (fsync)": [write],
    }
    for name in (
        "tier 3 load (cold)",
        "disk read (cold, one file)",
        "block files read raw (cold, one by one)",
        f"block files read raw (cold, {READERS} in flight)",
    ):
        out[name] = []
    for _ in range(rounds):
        out["disk read (cold, one file)"].append(_cold_read(probe))
        _drop_page_cache(disk)
        cold = Rig(model, length + 512, 2.0, disk)
        assert cold.host is not None
        cold.ttft(history + _tokens(rng, NEW))
        c = cold.host.counters()
        out["tier 3 load (cold)"].append(c["disk_bytes_read"] / max(1, c["disk_load_ns"]))
        out["block files read raw (cold, one by one)"].append(_files_read(disk))
        out[f"block files read raw (cold, {READERS} in flight)"].append(_files_read(disk, READERS))
    probe.unlink()
    return out


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _bandwidth_lines(bw: dict[str, list[float]]) -> list[str]:
    """The report's bandwidth section: each path's GB/s, and tier 3 against the disk."""
    lines: list[str] = []
    lines += [
        "",
        "## Bandwidth (GB/s), measured in the same run: median (min-max)",
        "",
        "| path | GB/s |",
        "|---|---|",
    ]
    lines += [f"| {k} | {_spread(v)} |" for k, v in bw.items()]
    t3 = [
        a / b
        for a, b in zip(bw["tier 3 load (cold)"], bw["disk read (cold, one file)"], strict=True)
    ]
    raw = [
        a / b
        for a, b in zip(
            bw["tier 3 load (cold)"],
            bw[f"block files read raw (cold, {READERS} in flight)"],
            strict=True,
        )
    ]
    lines += [
        "",
        f"Tier 2 moves {100 * bw['tier 2 load'][0] / bw['memcpy'][0]:.0f} % of "
        f"memcpy; tier 3 reads at {100 * statistics.median(t3):.0f} % "
        f"({100 * min(t3):.0f}-{100 * max(t3):.0f} % over the rounds) of the disk's "
        "cold sequential read of one file, and at "
        f"{100 * statistics.median(raw):.0f} % ({100 * min(raw):.0f}-{100 * max(raw):.0f} %) "
        f"of the same block files read raw, {READERS} at a time.",
        "",
        "Round by round (the disk's rates move between rounds; each round's reads are "
        "taken together):",
        "",
        f"| round | tier 3 load | one file | tier 3 / one file | {READERS} block files "
        "in flight | tier 3 / those |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rounds = zip(
        bw["tier 3 load (cold)"],
        bw["disk read (cold, one file)"],
        bw[f"block files read raw (cold, {READERS} in flight)"],
        strict=True,
    )
    for i, (tier3, one, files) in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {tier3:.2f} | {one:.2f} | {100 * tier3 / one:.0f} % | {files:.2f} "
            f"| {100 * tier3 / files:.0f} % |"
        )
    return lines


def report(
    ttft: dict[int, dict[str, float]],
    cost: dict[str, list[float]],
    bw: dict[str, list[float]],
    command: str,
    loads: dict[str, str],
) -> str:
    lines = report_head("KV tiers beyond the pool", command)
    lines += [
        "Load average (1, 5, 15 min) when each part began: "
        + "; ".join(f"{k}: {v}" for k, v in loads.items())
        + ".",
        "",
    ]
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
    direct = cost.pop("tier 2 store time")[0]
    off = cost["off"]
    lines += [
        f"## No reuse: {len(off)} interleaved rounds (distinct 1024-token prompts, "
        "16 output tokens)",
        "",
        "| tiers | seconds per round, median (min-max) | time / off, median "
        "(min-max over rounds) |",
        "|---|---|---|",
    ]
    for name, t in cost.items():
        ratios = [a / b for a, b in zip(t, off, strict=True)]
        lines.append(f"| {name} | {_spread(t)} | {_spread(ratios)} |")
    lines += [
        "",
        f"Time spent storing blocks into tier 2 (its counters): {direct * 1e3:.1f} ms "
        f"per request, {100 * direct / (statistics.median(off) / _PER_ROUND):.2f} % of a "
        "request with tiers off.",
    ]
    lines += _bandwidth_lines(bw)
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=5, help="no-reuse and bandwidth rounds")
    ap.add_argument("--dir", type=Path, default=None, help="tier-3 directory (a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_tiers.md"))
    args = ap.parse_args(argv)
    loads = {"turn-k TTFT": load_average()}
    torch.manual_seed(0)
    model = resolve_model(None)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        ttft = {n: turn_ttft(model, n, root / f"t{n}") for n in args.lengths}
        loads["no reuse"] = load_average()
        cost = no_reuse_cost(model, args.rounds, _PER_ROUND, 1024, root / "noreuse")
        loads["bandwidth"] = load_average()
        bw = bandwidth(model, root / "bw", args.rounds)
        loads["end"] = load_average()
    command = "python -m benchmarks.serving.kv_tiers " + shlex.join(sys.argv[1:])
    text = report(ttft, cost, bw, command, loads)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
