"""``benchmarks.engine.step_roofline``: perf's lines sorted into kernels, and one run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.engine import step_roofline
from benchmarks.engine.step_roofline import OTHER, kernel_of


def test_perf_lines_go_to_their_kernels() -> None:
    so = "_kernels.cpython-311-x86_64-linux-gnu.so"
    assert kernel_of(f"{so} [.] pdserve::(anonymous namespace)::rows_block<1>") == (
        "packed GEMV (layers and head)"
    )
    for a8 in ("a8_stream_tile<1>", "a8_kernel<4, 2>", "quantize_rows", "widen_tile"):
        # the avx512_vnni kernel's parts: int8 inputs times the int4 tiles
        got = kernel_of(f"{so} [.] pdserve::(anonymous namespace)::{a8}(signed char const*)")
        assert got == "packed GEMV (layers and head)", a8
    assert kernel_of(f"{so} [.] pdserve::decode_attention_rows<3, 4, true>") == "decode attention"
    assert kernel_of(f"{so} [.] pdserve::silu_mul_rows") == "other pdserve kernels"
    assert kernel_of("libgomp.so.1 [.] 0x000000000001de62") == "OpenMP waits"
    assert kernel_of("libtorch_cpu.so [.] at::native::add") == "torch"
    assert kernel_of("libpython3.11.so.1.0 [.] _PyEval_EvalFrameDefault") == "Python"
    assert kernel_of("[kernel.kallsyms] [k] do_syscall_64") == OTHER


def test_perf_samples_sums_each_kernels_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    report = "\n".join(
        [
            "# Samples: 10",
            "     6  _kernels.cpython-311.so  [.] pdserve::rows_block<1>",
            "     3  libgomp.so.1  [.] 0x1de62",
            "     1  _kernels.cpython-311.so  [.] pdserve::rows_block<2>",
            "",
        ]
    )

    def run(*_: object, **__: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 0, stdout=report)

    monkeypatch.setattr(step_roofline.subprocess, "run", run)
    got = step_roofline.perf_samples(Path("unused"))
    assert got == {"packed GEMV (layers and head)": 7, "OpenMP waits": 3}


def _perf_can_record() -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(
        ["perf", "record", "-o", "/dev/null", "--", "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _perf_can_record(), reason="perf cannot record here")
def test_a_run_on_the_tiny_model_writes_its_tables(tmp_path: Path) -> None:
    from bundled_models.tiny import tiny_model_dir

    out = tmp_path / "roofline.md"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.engine.step_roofline",
        "--model",
        str(tiny_model_dir()),
    ]
    cmd += ["--rows", "1,3", "--context", "40", "--seconds", "0.5", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    page = out.read_text()
    assert "### decode step, context 40" in page
    assert "### verification of 2 drafts, context 40" in page
    assert "| decode attention |" in page or "| torch |" in page
