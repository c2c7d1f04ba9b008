"""``python -m benchmarks.serving`` against the launched disaggregated server."""

from __future__ import annotations

import json
import shlex
import threading
import time
from pathlib import Path

from benchmarks.serving.__main__ import main
from tests.conftest import LaunchedServer


def _args(url: str, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--base-url",
        url,
        "--model",
        "tiny-qwen2-v1",
        "--tokenizer",
        str(tokenizer),
        *shlex.split("--random-input-len 24 --random-output-len 8 --disable-tqdm --result-file"),
        str(out),
        *extra,
    ]


def test_small_sweep_end_to_end(
    server: LaunchedServer, tokenizer_path: Path, tmp_path: Path
) -> None:
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(
        _args(
            server.url,
            tokenizer_path,
            out,
            "--num-prompts",
            "6",
            "--sweep",
            "request-rate=4,inf",
            "--plot",
            str(plot),
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
        )
    )
    assert rc == 0
    runs = json.loads(out.read_text())
    assert len(runs) == 2 and plot.stat().st_size > 0
    for r in runs:
        assert r["completed"] + r["failed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 6 * 8  # ignore_eos; counts from the server's usage
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            p50, p90, p99 = (r[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
            assert 0 <= p50 <= p90 <= p99, metric
        assert r["median_ttft_ms"] <= r["median_e2el_ms"]


def test_server_stopped_mid_run_counts_failures_and_exits_nonzero(
    tokenizer_path: Path, tmp_path: Path
) -> None:
    srv = LaunchedServer(shlex.split("--prefill 1 --decode 1 --device cpu --kv-cache-tokens 4096"))
    srv.wait_ready()
    out = tmp_path / "stopped.json"
    result: dict[str, int] = {}

    def bench() -> None:
        result["rc"] = main(
            _args(
                srv.url,
                tokenizer_path,
                out,
                "--num-prompts",
                "40",
                "--random-output-len",
                "200",
                "--max-concurrency",
                "4",
                "--request-timeout",
                "30",
            )
        )

    t = threading.Thread(target=bench)
    t0 = time.monotonic()
    t.start()
    time.sleep(3.0)
    srv.stop()
    t.join(90)
    assert not t.is_alive(), "the harness hung after the server stopped"
    assert time.monotonic() - t0 < 90
    r = json.loads(out.read_text())
    assert result["rc"] != 0
    assert r["completed"] + r["failed"] == 40 and r["failed"] > 0
    assert r["errors_summary"]
