"""Metric arithmetic of the serving benchmark, on hand-built request records."""

from __future__ import annotations

import pytest

from benchmarks.serving.metrics import RequestRecord, parse_goodput, summarize


def record(
    ttft: float, latency: float, tokens: int, itl: list[float] | None = None
) -> RequestRecord:
    return RequestRecord(
        prompt_len=10, success=True, ttft=ttft, latency=latency, output_tokens=tokens, itl=itl or []
    )


def test_tpot_excludes_the_first_token() -> None:
    assert record(0.1, 1.1, 11).tpot == pytest.approx(0.1)
    assert record(0.1, 0.1, 1).tpot is None


def test_percentiles_are_ordered_and_in_milliseconds() -> None:
    records = [record(0.01 * i, 1.0 + 0.01 * i, 5, [0.001 * i]) for i in range(1, 101)]
    out = summarize(records, duration=10.0, percentiles=[50, 90, 99])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert out[f"p50_{m}_ms"] <= out[f"p90_{m}_ms"] <= out[f"p99_{m}_ms"]
    assert out["median_ttft_ms"] == pytest.approx(505.0)
    assert out["mean_itl_ms"] == pytest.approx(50.5)


def test_throughputs_count_only_completed_requests() -> None:
    failed = RequestRecord(prompt_len=99, error="ConnectError: refused")
    out = summarize([record(0.1, 1.0, 20), record(0.2, 2.0, 30), failed], 5.0, [99])
    assert (out["completed"], out["failed"]) == (2, 1)
    assert out["request_throughput"] == pytest.approx(0.4)
    assert out["output_throughput"] == pytest.approx(10.0)
    assert out["total_token_throughput"] == pytest.approx(14.0)
    assert out["errors_summary"] == {"ConnectError: refused": 1}


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = record(0.05, 0.5, 10)  # ttft 50 ms, tpot 50 ms
    slow_first = record(0.5, 0.9, 10)  # ttft 500 ms
    slow_decode = record(0.05, 2.0, 10)  # tpot ~217 ms
    out = summarize(
        [fast, slow_first, slow_decode], 1.0, [99], parse_goodput(["ttft:100", "tpot:100"])
    )
    assert out["request_goodput"] == pytest.approx(1.0)
    assert summarize([fast], 1.0, [99])["request_goodput"] is None


@pytest.mark.parametrize("spec", ["ttft", "foo:10", "ttft:-1", "tpot:x"])
def test_bad_goodput_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_goodput([spec])


def test_all_failed_run_still_summarizes() -> None:
    out = summarize([RequestRecord(prompt_len=1, error="boom")] * 3, 0.0, [99])
    assert out["completed"] == 0 and out["failed"] == 3 and out["request_throughput"] == 0
