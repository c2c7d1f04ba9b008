"""The goodput benchmark's page, JSON and plot from hand-made points."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.goodput.__main__ import main
from benchmarks.goodput.drive import UNFINISHED, Sent, busy, describe_roles
from benchmarks.goodput.drive import _sent as _cut
from benchmarks.goodput.report import (
    Point,
    Run,
    merge_runs,
    plot,
    read_json,
    render,
    write_json,
)
from benchmarks.goodput.slo import Outcome, Slo
from benchmarks.goodput.traces import Arrival
from benchmarks.serving.metrics import RequestRecord


def _sent(ttft_s: float, tpot_s: float, ok: bool = True) -> Sent:
    arrival = Arrival(0.0, "chat", "chat", 200, 150)
    return Sent(
        arrival, Outcome(ok, ttft_s, tpot_s), 150 if ok else 0, 200, "" if ok else UNFINISHED
    )


def _run() -> Run:
    slo = Slo(ttft_ms=500, tpot_ms=50)
    run = Run(
        "python -m benchmarks.goodput --traces chat", slo, ["chat"], ["1p1d", "colocated1"], {}
    )
    run.settings["rates (req/s)"] = "chat: 1, 2, 3"
    good, slow = _sent(0.1, 0.02), _sent(0.9, 0.02)
    run.points += [
        Point("1p1d", "chat", 1.0, (good,) * 10, 12.0),
        Point("1p1d", "chat", 2.0, (good,) * 8 + (slow, _sent(0, 0, ok=False)), 12.0),
        Point("1p1d", "chat", 3.0, (slow,) * 10, 12.0),
        Point("colocated1", "chat", 1.0, (slow,) * 4, 12.0),
        Point("colocated1", "chat", 2.0, skipped="0 % at a lower rate"),
    ]
    run.notes.append("workers6: skipped")
    run.loads["1p1d"] = (3.25, 4.0)
    return run


def test_page_carries_command_slos_attainment_percentiles_and_goodput() -> None:
    page = render(_run(), "goodput.png", ["Machine:", "", "```", "cpu line", "```"])
    assert "Command: `python -m benchmarks.goodput --traces chat`" in page
    assert "TTFT <= 500 ms and TPOT <= 50 ms" in page
    assert "interpolated linearly" in page
    # 1p1d: 100 % at 1, 80 % at 2 -> 0.9 crossed half way: 1.50; colocated1 never meets.
    assert "| `1p1d` | 1.50 | 3.2 / 4.0 |" in page
    assert "| `colocated1` | < 1 | - |" in page
    # p90 of eight 100 ms and one 900 ms TTFT (the failed request has none): 260 ms.
    assert "| `1p1d` | 2 | 10 | 1 | 0 | 80 % | 100 / 260 | 20 / 20 |" in page
    assert "| `colocated1` | 2 | - | - | - | not sent: 0 % at a lower rate | | |" in page
    assert "![SLO attainment against rate](goodput.png)" in page
    assert "- workers6: skipped" in page and page.rstrip().endswith("```")


def test_json_and_plot_are_written(tmp_path: Path) -> None:
    run = _run()
    write_json(run, tmp_path / "g.json")
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["slo"] == {"ttft_ms": 500, "tpot_ms": 50}
    assert len(doc["points"]) == 5 and doc["points"][1]["sent"][9]["error"] == UNFINISHED
    plot(run, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_recorded_run_reads_back_and_is_judged_at_other_slos(tmp_path: Path) -> None:
    run = _run()
    write_json(run, tmp_path / "g.json")
    back = read_json(tmp_path / "g.json")
    assert back == run
    out = tmp_path / "re"
    argv = ["--from-json", str(tmp_path / "g.json"), "--trace-slo", "chat=1000:50"]
    assert main([*argv, "--out", str(out)]) == 0
    page = out.with_suffix(".md").read_text()
    # TTFT 900 ms now meets: 1p1d meets at every rate it was sent, colocated1 at its one.
    assert "TTFT <= 500 ms and TPOT <= 50 ms (chat: TTFT <= 1000 ms, TPOT <= 50 ms)" in page
    assert "| `1p1d` | >= 3 |" in page and "| `colocated1` | >= 1 |" in page
    assert "judged at the SLOs above by `python -m benchmarks.goodput --from-json" in page
    assert "Command: `python -m benchmarks.goodput --traces chat`" in page


def test_a_request_cut_at_the_deadline_is_judged_on_its_chunks_so_far() -> None:
    arrival = Arrival(0.0, "chat", "chat", 200, 150)
    slo = Slo(ttft_ms=500, tpot_ms=50)
    streaming = RequestRecord(200, ttft=0.2, itl=[0.03, 0.05])
    cut = _cut(arrival, streaming, finished=False)
    assert cut.outcome == Outcome(True, 0.2, 0.04, cut=True) and cut.outcome.meets(slo)
    assert cut.output_tokens == 3 and cut.error == ""
    slow = _cut(arrival, RequestRecord(200, ttft=0.2, itl=[0.2]), finished=False)
    assert slow.outcome.cut and not slow.outcome.meets(slo)
    # One chunk or none by the deadline: nothing to judge a TPOT on, a miss.
    for record in (RequestRecord(200, ttft=0.2), RequestRecord(200)):
        silent = _cut(arrival, record, finished=False)
        assert not silent.outcome.ok and silent.error == UNFINISHED
    done = RequestRecord(200, success=True, ttft=0.2, latency=1.0, output_tokens=5)
    assert _cut(arrival, done, finished=True).outcome == Outcome(True, 0.2, 0.2)


def test_busy_counts_engine_and_frontend_requests_in_flight() -> None:
    health = {
        "workers": [
            {"role": "prefill", "load": {"running_requests": 1.0, "waiting_requests": 2.0}},
            {"role": "frontend", "load": {"active_requests": 1.0}},
            {"role": "detokenizer", "load": {"active_requests": 0.0}},
        ]
    }
    assert busy(health) == 4
    assert busy({"workers": [{"role": "decode", "load": {"running_requests": 0.0}}]}) == 0


def test_a_workers_server_s_roles_are_described_and_listed_under_its_sweep(
    tmp_path: Path,
) -> None:
    health = {
        "workers": [
            {"index": 1, "role": "colocated", "serving_role": "decode"},
            {"index": 0, "role": "colocated", "serving_role": "prefill"},
            {"index": 0, "role": "detokenizer"},
        ]
    }
    metrics = "\n".join(
        [
            'pdserve_worker_role_changes_total{index="0"} 1',
            'pdserve_worker_role_changes_total{index="1"} 0',
            'pdserve_placements_total{kind="handoff"} 40',
            'pdserve_placements_total{kind="local"} 2',
            'pdserve_placements_total{kind="colocated"} 9',
        ]
    )
    said = describe_roles(health, metrics)
    assert said == "roles prefill / decode; 1 role changes; placed handoff 40, local 2, colocated 9"
    assert describe_roles({"workers": [{"index": 0, "role": "prefill"}]}, "") == ""
    run = _run()
    run.configs.append("workers2")
    run.points.append(Point("workers2", "chat", 1.0, (_sent(0.1, 0.02),) * 4, 12.0, roles=said))
    page = render(run, None, [])
    assert f"- `workers2` at 1 req/s: {said}" in page
    write_json(run, tmp_path / "run.json")
    assert read_json(tmp_path / "run.json").points[-1].roles == said


def test_runs_merge_with_a_later_point_replacing_an_earlier_one(tmp_path: Path) -> None:
    first, second = _run(), _run()
    second.configs = ["workers2", "1p1d"]
    later = Point("1p1d", "chat", 3.0, (_sent(0.1, 0.02),) * 10, 12.0)
    second.points = [later, Point("workers2", "chat", 1.0, (_sent(0.1, 0.02),) * 10, 12.0)]
    merged = merge_runs([first, second])
    assert merged.configs == ["1p1d", "colocated1", "workers2"]
    assert [p.rate for p in merged.sweep("1p1d", "chat")] == [1.0, 2.0, 3.0]
    assert merged.sweep("1p1d", "chat")[-1] is later
    assert any("1p1d` chat at 3 req/s was measured again in run 2" in n for n in merged.notes)
    for i, run in enumerate((first, second)):
        write_json(run, tmp_path / f"{i}.json")
    out = tmp_path / "merged"
    argv = ["--from-json", str(tmp_path / "0.json"), "--from-json", str(tmp_path / "1.json")]
    assert main([*argv, "--out", str(out)]) == 0
    assert "`workers2`" in out.with_suffix(".md").read_text()
