"""The server configurations a goodput run compares, and how each is launched.

A configuration is named as ``--configs`` takes it: ``1p2d`` (``--prefill 1 --decode 2``),
``colocated2`` (``--colocated 2``), ``workers4`` (``--workers 4``: roles the server
chooses, where ``launch`` has that option).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Fixed splits, smallest first; a host runs those with at most WORKERS_PER_CORE engine
# workers a core (on 2 cores: 1p1d, 1p2d and 2p4d, the ``make run`` default).
FIXED_SPLITS = ((1, 1), (1, 2), (2, 4), (4, 8), (8, 16))
WORKERS_PER_CORE = 3
_SPLIT = re.compile(r"(\d+)p(\d+)d")
_NAMED = re.compile(r"(colocated|workers)(\d+)")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    launch_args: tuple[str, ...]

    @property
    def adaptive(self) -> bool:
        return "--workers" in self.launch_args


def parse_config(name: str) -> ServerConfig:
    """``1p2d``, ``colocated2`` or ``workers4`` as launch arguments; ValueError otherwise."""
    if m := _SPLIT.fullmatch(name):
        p, d = int(m[1]), int(m[2])
        if p < 1 or d < 1:
            raise ValueError(f"{name}: a split needs at least one prefill and one decode worker")
        return ServerConfig(name, ("--prefill", str(p), "--decode", str(d)))
    if m := _NAMED.fullmatch(name):
        if int(m[2]) < 1:
            raise ValueError(f"{name}: needs at least one worker")
        return ServerConfig(name, (f"--{m[1]}", m[2]))
    raise ValueError(f"unknown configuration {name!r}: use e.g. 1p2d, colocated2 or workers4")


def default_configs(cores: int | None = None) -> list[str]:
    """Every fixed split that fits ``cores`` (default: this host's), co-located 1 and 2,
    and the adaptive mode with as many workers as the largest split that fits."""
    cores = cores or os.cpu_count() or 1
    splits = [(p, d) for p, d in FIXED_SPLITS if p + d <= WORKERS_PER_CORE * cores]
    splits = splits or [FIXED_SPLITS[0]]
    largest = max(p + d for p, d in splits)
    return [*(f"{p}p{d}d" for p, d in splits), "colocated1", "colocated2", f"workers{largest}"]


def launch_has_workers(tree: Path | None = None) -> bool:
    """Whether ``launch --help`` lists ``--workers`` (roles the server chooses), run from
    ``tree`` (default: this checkout)."""
    root = tree or Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=root,
    ).stdout
    return re.search(r"^\s*--workers\b", out, re.MULTILINE) is not None
