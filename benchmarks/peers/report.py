"""The head-to-head's tables: figures side by side, then pdserve / peer ratios. Pure: no I/O.

A ``Point`` is one server measured at one (workload, concurrency). Servers come in groups,
one per weight precision (unquantized, 8-bit, 4-bit); within a group every pdserve
server's point is divided by each peer's point at the same (workload, concurrency).
Reports written before groups existed have one baseline and no groups, and render as then.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# (column heading, key in a benchmarks.serving summary, digits); throughputs, then latencies
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("out tok/s", "output_throughput", 1),
    ("req/s", "request_throughput", 3),
    ("TTFT p50 ms", "median_ttft_ms", 0),
    ("TTFT p99 ms", "p99_ttft_ms", 0),
    ("ITL p50 ms", "median_itl_ms", 1),
    ("ITL p99 ms", "p99_itl_ms", 1),
    ("TPOT p50 ms", "median_tpot_ms", 1),
)
# the ratios against each peer: throughput, time to first token, inter-token latency
PEER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("out tok/s", "output_throughput"),
    ("TTFT p50", "median_ttft_ms"),
    ("ITL p50", "median_itl_ms"),
)


@dataclass(frozen=True)
class Point:
    """One server at one load: the figures ``benchmarks.serving.metrics.summarize`` gave."""

    server: str
    workload: str
    concurrency: int
    figures: dict[str, float]
    completed: int
    failed: int
    load_avg: float  # 1-minute load average when the point finished: the machine is shared
    errors: dict[str, int] = field(default_factory=dict)  # error text -> failed requests


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``; NaN when either side has no figure (a failed or empty run)."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs <= 0 or ours <= 0:
        return math.nan
    return ours / theirs


def _fmt(x: float, digits: int = 1) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def _key(p: Point) -> tuple[str, int]:
    return p.workload, p.concurrency


def _server(p: Point) -> str:
    # NOTE: figures of a point with failures cover only its completed requests, and its
    # throughput divides them by the whole run: a reader must see that in every row.
    return p.server if not p.failed else f"{p.server} ({p.failed} failed)"


def _head(*extra: str) -> list[str]:
    names = ["concurrency", "server", *(c[0] for c in COLUMNS), *extra]
    return ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]


def figure_rows(points: Sequence[Point], workload: str) -> list[str]:
    """One row per (concurrency, server) of ``workload``; servers in order of first appearance."""
    order = {s: i for i, s in enumerate(dict.fromkeys(p.server for p in points))}
    rows = _head("ok / failed", "load")
    mine = [p for p in points if p.workload == workload]
    for p in sorted(mine, key=lambda p: (p.concurrency, order[p.server])):
        cells = [_fmt(p.figures.get(key, math.nan), d) for _, key, d in COLUMNS]
        rows.append(
            f"| {p.concurrency} | {_server(p)} | "
            + " | ".join(cells)
            + f" | {p.completed} / {p.failed} | {p.load_avg:.1f} |"
        )
    return rows


def failure_lines(points: Sequence[Point], workload: str) -> list[str]:
    """What failed requests said, per server and concurrency (empty when none failed)."""
    return [
        f"- {p.server}, concurrency {p.concurrency}: {n} x `{error[:200]}`"
        for p in points
        if p.workload == workload
        for error, n in p.errors.items()
    ]


def ratio_rows(points: Sequence[Point], workload: str, baseline: str) -> list[str]:
    """pdserve / baseline for every non-baseline server of ``workload``, by concurrency."""
    base = {_key(p): p for p in points if p.server == baseline and p.workload == workload}
    rows = _head()
    ours = [p for p in points if p.server != baseline and p.workload == workload]
    for p in sorted(ours, key=lambda p: (p.concurrency, p.server)):
        theirs = base[_key(p)].figures if _key(p) in base else {}
        nan = math.nan
        cells = [_fmt(ratio(p.figures.get(k, nan), theirs.get(k, nan)), 2) for _, k, _ in COLUMNS]
        rows.append(f"| {p.concurrency} | {_server(p)} | " + " | ".join(cells) + " |")
    return rows


def peer_ratio_rows(
    points: Sequence[Point], workload: str, ours: Sequence[str], peers: Sequence[str]
) -> list[str]:
    """Each pdserve server / each peer of one group, by concurrency (a dash where either
    side has no figure)."""
    at = {(p.server, p.concurrency): p for p in points if p.workload == workload}
    levels = sorted({c for (s, c) in at if s in ours or s in peers})
    names = ["concurrency", "pdserve", "peer", *(c[0] for c in PEER_COLUMNS)]
    rows = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
    for c in levels:
        for name in ours:
            for peer in peers:
                mine, theirs = at.get((name, c)), at.get((peer, c))
                if mine is None and theirs is None:
                    continue
                cells = [
                    _fmt(
                        ratio(
                            mine.figures.get(k, math.nan) if mine else math.nan,
                            theirs.figures.get(k, math.nan) if theirs else math.nan,
                        ),
                        2,
                    )
                    for _, k in PEER_COLUMNS
                ]
                shown = _server(mine) if mine else name
                rows.append(
                    f"| {c} | {shown} | {_server(theirs) if theirs else peer} | "
                    + " | ".join(cells)
                    + " |"
                )
    return rows


@dataclass(frozen=True)
class Report:
    """Everything the results file says besides the tables' figures."""

    title: str
    command: str
    machine: str
    setup: Sequence[str]  # one markdown bullet per line: model, dtype, each server's flags
    workloads: Sequence[tuple[str, str]]  # (name, how it is made)
    baseline: str
    baseline_failure: str | None = None  # why the baseline could not run, verbatim
    # (precision, pdserve servers, peer servers): each group gets its own tables
    groups: Sequence[tuple[str, Sequence[str], Sequence[str]]] = ()
    peer_failures: Mapping[str, str] = field(default_factory=dict)  # peer -> why it is missing


def _page_head(report: Report) -> list[str]:
    """Title, command, machine and setup: how every page of peer figures begins."""
    head = [f"# {report.title}", "", f"Command: `{report.command}`", ""]
    machine = ["Machine:", "", "```", report.machine, "```", ""]
    return [*head, *machine, "Setup:", "", *(f"- {s}" for s in report.setup), ""]


def render(report: Report, points: Iterable[Point]) -> str:
    pts = list(points)
    if report.groups:
        return _render_groups(report, pts)
    out = _page_head(report)
    if report.baseline_failure is not None:
        out += [
            f"**{report.baseline} could not run here**, so there are no ratios:",
            "",
            "```",
            report.baseline_failure.rstrip(),
            "```",
            "",
        ]
    else:
        out += [
            f"Ratios are pdserve / {report.baseline}: above 1.00 is better for pdserve in "
            "the throughput columns (out tok/s, req/s), below 1.00 is better in the latency "
            "columns.",
            "",
        ]
    out += [
        "`load` is the machine's 1-minute load average as the point finished (the cores "
        "are shared with other jobs).",
        "",
    ]
    for name, how in report.workloads:
        out += [f"## {name}", "", how, "", *figure_rows(pts, name), ""]
        if failed := failure_lines(pts, name):
            out += ["Failed requests:", "", *failed, ""]
        if report.baseline_failure is None:
            ratios = ratio_rows(pts, name, report.baseline)
            out += [f"pdserve / {report.baseline}:", "", *ratios, ""]
    return "\n".join(out)


def _render_groups(report: Report, pts: list[Point]) -> str:
    out = _page_head(report)
    for peer, why in report.peer_failures.items():
        out += [
            f"**{peer} could not run here**, so its rows and ratios are missing:",
            "",
            "```",
            why.rstrip(),
            "```",
            "",
        ]
    out += [
        "Servers are compared within a precision group (the same weights, as each "
        "server stores them). Ratios are pdserve / peer: above 1.00 is better for "
        "pdserve in out tok/s, below 1.00 is better in TTFT and ITL.",
        "",
        "`load` is the machine's 1-minute load average as the point finished (the cores "
        "are shared with other jobs).",
        "",
    ]
    for name, how in report.workloads:
        out += [f"## {name}", "", how, ""]
        for precision, ours, peers in report.groups:
            mine = [p for p in pts if p.server in ours or p.server in peers]
            out += [f"### {precision}", "", *figure_rows(mine, name), ""]
            if failed := failure_lines(mine, name):
                out += ["Failed requests:", "", *failed, ""]
            if ours and peers:
                out += ["pdserve / peer:", "", *peer_ratio_rows(mine, name, ours, peers), ""]
    return "\n".join(out)


def summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    """The scalar figures of a ``summarize`` result (drops the per-request lists)."""
    return {k: float(v) for k, v in summary.items() if isinstance(v, int | float)}
