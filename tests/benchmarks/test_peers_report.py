"""The head-to-head's tables, on hand-made points (no server, no vLLM)."""

from __future__ import annotations

import math

import pytest

from benchmarks.peers.report import COLUMNS, Point, Report, ratio, ratio_rows, render


def point(server: str, concurrency: int, scale: float, workload: str = "random") -> Point:
    figures = {key: scale * (i + 1) for i, (_, key, _) in enumerate(COLUMNS)}
    return Point(server, workload, concurrency, figures, completed=8, failed=0, load_avg=1.5)


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def test_ratio_divides_ours_by_theirs_and_refuses_missing_figures() -> None:
    assert ratio(3.0, 2.0) == pytest.approx(1.5)
    assert math.isnan(ratio(1.0, 0.0))  # a baseline that produced nothing
    assert math.isnan(ratio(0.0, 1.0))  # ours produced nothing
    assert math.isnan(ratio(math.nan, 1.0))


def test_ratio_rows_pair_each_pdserve_point_with_the_baseline_at_the_same_load() -> None:
    points = [
        point("vLLM", 1, 1.0),
        point("pd", 1, 2.0),
        point("vLLM", 4, 4.0),
        point("pd", 4, 2.0),
        point("pd", 8, 1.0),
    ]
    rows = ratio_rows(points, "random", "vLLM")
    body = [cells(r) for r in rows[2:]]
    assert [r[:2] for r in body] == [["1", "pd"], ["4", "pd"], ["8", "pd"]]
    assert body[0][2:] == ["2.00"] * len(COLUMNS)
    assert body[1][2:] == ["0.50"] * len(COLUMNS)
    assert body[2][2:] == ["–"] * len(COLUMNS)  # no baseline at c=8: no ratio, not a guess


def test_render_puts_figures_ratios_and_the_command_in_the_file() -> None:
    report = Report(
        "t",
        "python -m benchmarks.peers --model m",
        "cpu line",
        ["model: m"],
        [("random", "how random is made")],
        "vLLM",
    )
    text = render(report, [point("pd", 1, 2.0), point("vLLM", 1, 1.0)])
    assert "`python -m benchmarks.peers --model m`" in text and "cpu line" in text
    figures = text.split("## random")[1].split("pdserve / vLLM:")[0]
    servers = [cells(r)[1] for r in figures.splitlines() if r.startswith("| 1 ")]
    assert servers == ["pd", "vLLM"]  # order of first appearance
    assert "| 1 | pd | 2.0 | 4.000 | 6 |" in text  # digits per column
    assert "| 1 | pd | 2.00 | 2.00 |" in text


def test_render_lists_what_failed_requests_said() -> None:
    report = Report("t", "cmd", "m", [], [("random", "")], "vLLM")
    failed = Point("pd", "random", 8, {}, 8, 8, 1.0, {"RuntimeError: HTTP 503: busy": 8})
    text = render(report, [point("vLLM", 8, 1.0), failed])
    assert "- pd, concurrency 8: 8 x `RuntimeError: HTTP 503: busy`" in text
    assert "| 8 | pd (8 failed) | – |" in text  # no figures: a dash, not a zero


def test_render_says_why_the_baseline_is_missing_and_leaves_out_ratios() -> None:
    report = Report(
        "t", "cmd", "m", [], [("random", "")], "vLLM", baseline_failure="ImportError: no AVX512\n"
    )
    text = render(report, [point("pd", 1, 2.0)])
    assert "vLLM could not run here" in text and "ImportError: no AVX512" in text
    assert "pdserve / vLLM:" not in text
