"""``python -m benchmarks.goodput`` end to end: one launched tiny-model server, two rates,
two requests a point, bounded by the point deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.goodput.__main__ import main
from bundled_models.tiny import tiny_model_dir


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_goodput_run_launches_sweeps_and_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "goodput"
    argv = [
        *("--model", str(tiny_model_dir()), "--configs", "colocated1"),
        *("--traces", "doc", "--rates", "doc=1,2", "--min-requests", "2", "--max-requests", "2"),
        *("--drain-s", "60", "--warm-concurrency", "1", "--out", str(out)),
        *("--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000", "--stop-below", "0"),
        *("--launch-args", "--max-model-len 4096"),
    ]
    assert main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    points = [p for p in doc["points"] if p["config"] == "colocated1"]
    assert [p["rate"] for p in points] == [1.0, 2.0]
    for p in points:
        assert len(p["sent"]) == 2
        for s in p["sent"]:
            # Served in full: the exact prompt length and ignore_eos's forced output length.
            assert s["error"] == "" and s["outcome"]["ok"]
            assert s["server_prompt_tokens"] == s["arrival"]["prompt_len"]
            assert s["output_tokens"] == s["arrival"]["output_len"]
    page = out.with_suffix(".md").read_text()
    # Targets no tiny-model request can miss: every swept rate meets them.
    assert "| `colocated1` | >= 2 |" in page
    assert "TTFT <= 60000 ms and TPOT <= 10000 ms" in page
    assert out.with_suffix(".png").stat().st_size > 0
