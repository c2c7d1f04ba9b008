"""The per-process CPU reading of ``benchmarks.serving.cpu_split``."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.harness.processes import stat_cpu_seconds
from benchmarks.serving.cpu_split import process_tree


def test_process_tree_keeps_the_root_and_its_descendants_only() -> None:
    ps = [
        "  1     0 /sbin/init",
        " 10     1 python -m launcher.cli --colocated 1",
        " 11    10 pdserve:colocated-0",
        " 12    10 pdserve:frontend-0",
        " 13    11 pdserve:helper with spaces",
        " 20     1 unrelated",
        "",
    ]
    tree = process_tree(10, ps)
    assert sorted(tree) == [10, 11, 12, 13]
    assert tree[13] == "pdserve:helper with spaces"


def test_cpu_seconds_counts_fields_after_a_name_with_spaces_and_parentheses() -> None:
    # pid (comm) state ppid ... utime(14th) stime(15th), 1-based over the whole line.
    rest = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", "250", "50", "0", "0"]
    line = "42 (a (b) c) " + " ".join(rest)
    assert stat_cpu_seconds(line, 100) == 3.0


def test_cpu_seconds_of_this_process_grows_with_work() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    stat = Path(f"/proc/{os.getpid()}/stat")
    before = stat_cpu_seconds(stat.read_text(), ticks)
    x = 0
    for i in range(3_000_000):
        x += i * i
    assert x > 0
    assert stat_cpu_seconds(stat.read_text(), ticks) > before
