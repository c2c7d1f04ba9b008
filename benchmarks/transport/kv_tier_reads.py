"""Where a tier-3 read's time goes: per-block costs of ``DiskStore.read`` and a cold load
of a 4k-token history's files through the loader threads, into a fresh tier 2 and into
one whose pages are already mapped, against the disk's own read of one large file.

    python -m benchmarks.transport.kv_tier_reads [--blocks 256] [--rounds 2] [--dir DIR]

Blocks have SmolLM2-135M's bf16 geometry (16 tokens, 368,640 payload bytes). "Cold"
drops the files from the page cache first (posix_fadvise), as benchmarks/kv_tiers does.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from isal import isal_zlib

from benchmarks.harness.machine import load_average, report_head
from engine.kv.tiers.disk_load import BlockRead, DiskLoader
from engine.kv.tiers.disk_store import HEADER_BYTES, DiskStore
from engine.kv.tiers.host_store import Geometry, HostStore, create_segment
from engine.kv.tiers.keys import chain_keys, root_key

BS, NB = 16, 368_640
NS = bytes(16)


class Files:
    """``n`` block files of random payloads in ``root``, and a file of their total size."""

    def __init__(self, root: Path, n: int) -> None:
        self.disk = DiskStore(root, NS, BS, NB)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 40_000, n * BS).tolist()
        self.keys = chain_keys(root_key(NS, None), tokens, BS)
        self.parents = [root_key(NS, None), *self.keys[:-1]]
        self.tokens = np.asarray(tokens, dtype="<u4").reshape(n, BS)
        for i, k in enumerate(self.keys):
            self.disk.write(k, self.parents[i], self.tokens[i], rng.integers(0, 255, NB, np.uint8))
        self.big = root / "one_file.bin"
        self.big.write_bytes(os.urandom(n * self.disk.file_nbytes))
        os.sync()
        self.paths = [self.disk.path(k) for k in self.keys]
        self.out = np.empty((n, NB), np.uint8)

    def drop(self) -> None:
        for p in [*self.paths, self.big]:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def read_one_file(self) -> float:
        """GB/s of the disk's cold sequential read of the large file."""
        self.drop()
        t0, n = time.perf_counter(), 0
        fd = os.open(self.big, os.O_RDONLY)
        while chunk := os.read(fd, 1 << 22):
            n += len(chunk)
        os.close(fd)
        return n / (time.perf_counter() - t0) / 1e9

    def load(self, mapped: bool) -> float:
        """GB/s of a cold load of every file through ``DiskLoader`` (checks and the
        promotion into tier 2 included): into a fresh 2 GiB tier 2, or a mapped one."""
        g = Geometry.for_budget(2 << 30, BS, NB)
        fd, buf = create_segment(g.offsets[3])
        if mapped:
            buf = memoryview(mmap.mmap(fd, g.offsets[3], mmap.MAP_SHARED | mmap.MAP_POPULATE))
        HostStore.format(buf, g)
        loader = DiskLoader(self.disk, HostStore(fd, buf))
        reads = [
            BlockRead(k, self.parents[i], self.tokens[i], i, self.out[i])
            for i, k in enumerate(self.keys)
        ]
        self.drop()
        t0 = time.perf_counter()
        got = loader.start(0, reads, lambda blocks: None).settle()
        dt = time.perf_counter() - t0
        os.close(fd)
        assert len(got) == len(reads), "a block failed its checks"
        return len(got) * self.disk.file_nbytes / dt / 1e9


def per_block_us(files: Files, fn: Callable[[int], object]) -> float:
    """Best of 3 passes over every block (warm page cache), microseconds a block."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(len(files.keys)):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / len(files.keys) * 1e6)
    return best


def warm_costs(f: Files) -> dict[str, float]:
    head = bytearray(HEADER_BYTES + 4 * BS)

    def open_readv_close(i: int) -> None:
        fd = os.open(f.paths[i], os.O_RDONLY)
        os.readv(fd, [head, f.out[i].data])
        os.close(fd)

    return {
        "open + readv + close": per_block_us(f, open_readv_close),
        "crc32, zlib": per_block_us(f, lambda i: zlib.crc32(f.out[i].data)),
        "crc32, ISA-L (isal)": per_block_us(f, lambda i: isal_zlib.crc32(f.out[i].data)),
        "DiskStore.read (every check)": per_block_us(
            f, lambda i: f.disk.read(f.keys[i], f.parents[i], f.tokens[i], f.out[i])
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (a temp dir)")
    args = ap.parse_args(argv)
    lines = report_head(
        "Where a tier-3 read's time goes", "python -m benchmarks.transport.kv_tier_reads"
    )
    lines += [f"Load average at the start: {load_average()}.", ""]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        f = Files(Path(tmp), args.blocks)
        lines += ["| per block, warm page cache | us |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in warm_costs(f).items()]
        lines += ["", "| round | one file (GB/s) | load, fresh tier 2 | load, mapped tier 2 |"]
        lines += ["|---|---|---|---|"]
        for r in range(args.rounds):  # interleaved: each round sees the same machine
            one, fresh, mapped = f.read_one_file(), f.load(False), f.load(True)
            lines.append(f"| {r} | {one:.2f} | {fresh:.2f} | {mapped:.2f} |")
    lines += ["", f"Load average at the end: {load_average()}.", ""]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
