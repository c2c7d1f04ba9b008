"""``python -m benchmarks.serving`` end to end against the app on a live uvicorn server."""

from __future__ import annotations

import json
import shlex
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.serving.__main__ import main
from frontend.http.app import build_app
from tests.frontend.conftest import MODEL, LiveServer, make_settings
from tests.frontend.reference_client import ReferenceEngineClient


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> tuple[Any, Any]:
    return ReferenceEngineClient.load(default_model_path)


def serve(reference: tuple[Any, Any], **kw: Any) -> LiveServer:
    engine = ReferenceEngineClient(*reference, **kw)
    return LiveServer(build_app(engine, engine.tokenizer, make_settings()))


def bench_args(base_url: str, tokenizer_path: Path, extra: str) -> list[str]:
    """The harness's arguments against ``base_url``: 4 small random prompts, then
    ``extra`` (one shell-quoted string)."""
    return [
        "--base-url",
        base_url,
        "--model",
        MODEL,
        "--tokenizer",
        str(tokenizer_path),
        *shlex.split("--num-prompts 4 --random-input-len 12 --random-output-len 6 --disable-tqdm"),
        *shlex.split(extra),
    ]


Bench = Callable[..., tuple[int, Any]]


@pytest.fixture
def bench(reference: tuple[Any, Any], tokenizer_path: Path, tmp_path: Path) -> Bench:
    """Runs the harness with ``extra`` flags against a reference server made with ``kw``:
    its exit code and the result JSON it wrote."""

    def run(extra: str, **kw: Any) -> tuple[int, Any]:
        out = tmp_path / "result.json"
        with serve(reference, **kw) as srv:
            rc = main(bench_args(srv.base_url, tokenizer_path, f"--result-file {out} {extra}"))
        return rc, json.loads(out.read_text())

    return run


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_run_reports_exact_output_lengths(bench: Bench, tmp_path: Path, endpoint: str) -> None:
    plot = tmp_path / "r.png"
    rc, result = bench(
        f"--endpoint {endpoint} --goodput e2el:60000 --plot {plot} --request-rate 20"
    )
    assert rc == 0
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["output_lens"] == [6, 6, 6, 6]  # ignore_eos + usage from the server
    assert result["total_output_tokens"] == 24 and result["request_goodput"] > 0
    assert result["median_ttft_ms"] > 0 and len(result["itls"][0]) >= 1
    assert plot.stat().st_size > 0


def test_sweep_writes_one_result_per_point(bench: Bench, tmp_path: Path) -> None:
    rc, results = bench(f"--sweep max-concurrency=1,2 --plot {tmp_path / 's.png'}")
    assert rc == 0 and [r["max_concurrency"] for r in results] == [1, 2]
    assert all(r["completed"] == 4 for r in results)
    assert (tmp_path / "s.png").stat().st_size > 0


def test_unreachable_server_fails_every_request_without_hanging(
    tokenizer_path: Path, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(
        bench_args(
            f"http://127.0.0.1:{port}", tokenizer_path, f"--result-file {tmp_path / 'f.json'}"
        )
    )
    result = json.loads((tmp_path / "f.json").read_text())
    assert rc == 1 and result["failed"] == 4 and result["completed"] == 0
    assert any("ConnectError" in e for e in result["errors_summary"])


def test_stalled_requests_time_out_and_are_counted(bench: Bench) -> None:
    rc, result = bench("--request-timeout 0.5 --random-output-len 40", step_delay_s=0.3)
    assert rc == 1 and result["failed"] == 4


def test_a_conversations_next_turn_is_sent_only_after_the_previous_one_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio
    import time

    from benchmarks.serving import runner
    from benchmarks.serving.datasets import SampleRequest
    from benchmarks.serving.metrics import RequestRecord

    spans: dict[str, tuple[float, float]] = {}

    async def fake_send(cfg: Any, req: SampleRequest, tok: Any) -> RequestRecord:
        start = time.monotonic()
        await asyncio.sleep(0.05)
        spans[req.prompt] = (start, time.monotonic())
        return RequestRecord(prompt_len=req.prompt_len, success=True)

    monkeypatch.setattr(runner, "send_request", fake_send)
    reqs = [
        SampleRequest("a0", 1, 1),
        SampleRequest("b0", 1, 1),
        SampleRequest("a1", 1, 1, after=0),
        SampleRequest("b1", 1, 1, after=1),
        SampleRequest("a2", 1, 1, after=2),
    ]
    cfg = runner.RequestConfig("http://unused", "/v1/completions", "m", True)
    records, _ = asyncio.run(runner.run_load(reqs, cfg, runner.LoadConfig(), None, True))
    assert all(r.success for r in records)
    for first, then in (("a0", "a1"), ("a1", "a2"), ("b0", "b1")):
        assert spans[then][0] >= spans[first][1]
    assert spans["b0"][0] < spans["a0"][1]  # conversations run side by side
