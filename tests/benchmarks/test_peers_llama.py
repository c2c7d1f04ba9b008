"""The llama.cpp peer and pdserve's weight variants in benchmarks.peers: the build flags
and every command line, checked without building, converting or starting anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.peers.__main__ as cli
from benchmarks.harness.machine import vector_flags
from benchmarks.harness.servers import ServerFailed
from benchmarks.peers import contenders, llama_cpp
from benchmarks.peers.report import Point, Report, peer_ratio_rows, render

AVX512_VM = (
    "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd "
    "avx512vl avx512dq avx512bw avx512_vnni avx512_bf16 avx512vbmi avx_vnni amx_tile "
    "amx_int8 amx_bf16\n"
)
AVX2_ONLY = "flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2\n"


def flags_of(cpuinfo: str) -> dict[str, str]:
    flags = llama_cpp.cmake_flags(llama_cpp.cpu_flags(cpuinfo))
    return dict(f[2:].split("=", 1) for f in flags if f.startswith("-D"))


def test_build_names_every_extension_the_cpu_reports_and_never_native_or_amx() -> None:
    d = flags_of(AVX512_VM)
    assert d["GGML_NATIVE"] == "OFF"
    for opt in (
        "GGML_AVX2",
        "GGML_FMA",
        "GGML_F16C",
        "GGML_AVX512",
        "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16",
    ):
        assert d[opt] == "ON", opt
    # the VM reports AMX, and a build using it died with SIGILL: always off
    assert d["GGML_AMX_TILE"] == d["GGML_AMX_INT8"] == d["GGML_AMX_BF16"] == "OFF"
    assert d["LLAMA_BUILD_NUMBER"] == str(llama_cpp.build_number(llama_cpp.LLAMA_CPP_SPEC))


def test_build_leaves_out_what_the_cpu_does_not_report() -> None:
    d = flags_of(AVX2_ONLY)
    assert d["GGML_AVX2"] == "ON"
    assert d["GGML_AVX512"] == d["GGML_AVX512_VNNI"] == d["GGML_AVX512_BF16"] == "OFF"
    # AVX512_VNNI needs AVX512F itself
    assert flags_of(AVX2_ONLY.rstrip() + " avx512_vnni\n")["GGML_AVX512_VNNI"] == "OFF"
    with pytest.raises(ServerFailed, match="avx2"):
        llama_cpp.cmake_flags(llama_cpp.cpu_flags("flags\t: fpu avx fma f16c\n"))


def test_a_build_with_the_same_flags_is_not_redone(tmp_path: Path) -> None:
    build = llama_cpp.LlamaBuild(
        tmp_path,
        llama_cpp.source_dir(tmp_path),
        llama_cpp.cmake_flags(llama_cpp.cpu_flags(AVX2_ONLY)),
    )
    for exe in (build.server, build.quantize):
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("")
    stamp = {
        "spec": build.spec,
        "cmake_flags": list(build.cmake_flags),
        "targets": list(llama_cpp.TARGETS),
    }
    (tmp_path / "build" / "pdserve-build.json").write_text(json.dumps(stamp))
    assert llama_cpp.ensure_llama_cpp(tmp_path, cpuinfo=AVX2_ONLY) == build  # no pip, no cmake


def test_llama_server_gives_every_slot_a_whole_max_model_len() -> None:
    build = llama_cpp.LlamaBuild(Path("x"), Path("src"), ())
    argv = llama_cpp.server_argv(
        build, Path("m.gguf"), threads=2, parallel=8, max_model_len=2048, alias="Model"
    )
    assert argv[0] == str(Path("x/build/bin/llama-server"))
    pairs = dict(zip(argv[1::2], argv[2::2]))
    assert pairs["-m"] == "m.gguf" and pairs["-t"] == "2" and pairs["--parallel"] == "8"
    assert pairs["-c"] == str(8 * 2048) and pairs["--alias"] == "Model"
    assert pairs["--port"] == "{port}" and pairs["--host"] == "127.0.0.1"


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "Tiny-Model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    monkeypatch.setattr(cli, "launch_help", lambda: "--kv-cache-memory --quantization")
    return d


def dry_plan(model: Path, *extra: str) -> list[cli.Group]:
    args = cli.parse_args(["--model", str(model), "--dry-run", "--llama-dir", "L", *extra])
    s = cli.Settings(model, "float32", 1, 2048, 2, 8)
    groups, failures, _ = cli.plan(args, s)
    assert failures == {}
    return groups


def test_plan_groups_servers_by_precision_with_the_peers_of_each(model: Path) -> None:
    groups = dry_plan(model)
    assert [g.precision for g in groups] == ["F32", "Q8_0", "Q4_1"]
    names = {g.precision: [s.name for s in g.specs] for g in groups}
    assert names["F32"] == [
        "vLLM F32",
        "llama.cpp F32",
        "pdserve 1P+1D F32",
        "pdserve co-located F32",
    ]
    assert names["Q8_0"] == ["llama.cpp Q8_0", "pdserve 1P+1D int8", "pdserve co-located int8"]
    # vLLM in bfloat16 joins the Q4_1 group on CPUs with native bfloat16 only.
    native_bf16 = {"avx512_bf16", "amx_bf16"} & set(vector_flags())
    assert names["Q4_1"] == [
        *(["vLLM BF16"] if native_bf16 else []),
        "llama.cpp Q4_1",
        "pdserve 1P+1D int4",
        "pdserve co-located int4",
        "pdserve 1P+1D GGUF Q4_1",
        "pdserve co-located GGUF Q4_1",
    ]
    without = {g.precision: [s.name for s in g.specs] for g in dry_plan(model, "--no-vllm-bf16")}
    assert "vLLM BF16" not in without["Q4_1"]


def test_pdserve_variants_pass_quantization_and_the_peers_gguf(model: Path) -> None:
    groups = dry_plan(
        model,
        "--pdserve",
        "pdserve co-located",
        "--no-vllm",
        "--pdserve-quant",
        "none,int8,gguf-q8_0,gguf-q4_1",
    )
    by = {s.name: list(s.argv) for g in groups for s in g.specs}

    def opt(name: str, flag: str) -> str:
        return by[name][by[name].index(flag) + 1]

    assert opt("pdserve co-located F32", "--quantization") == "none"
    assert opt("pdserve co-located int8", "--quantization") == "int8"
    assert opt("pdserve co-located int8", "--model") == str(model)
    # the GGUF variants serve the very file llama.cpp serves in their group
    assert opt("pdserve co-located GGUF Q8_0", "--quantization") == "auto"
    assert opt("pdserve co-located GGUF Q8_0", "--model") == opt("llama.cpp Q8_0", "-m")
    assert opt("pdserve co-located GGUF Q4_1", "--model") == opt("llama.cpp Q4_1", "-m")
    for name, argv in by.items():  # every server is asked for the name the workloads send
        assert model.name in argv, name
    assert "vLLM F32" not in by


def test_precisions_and_no_llama_cpp_narrow_the_plan(model: Path) -> None:
    groups = dry_plan(model, "--precisions", "F32", "--no-llama-cpp", "--no-vllm")
    assert [(g.precision, [s.name for s in g.specs]) for g in groups] == [
        ("F32", ["pdserve 1P+1D F32", "pdserve co-located F32"])
    ]
    with pytest.raises(SystemExit, match="unknown"):
        dry_plan(model, "--pdserve-quant", "fp8")


def test_without_launch_quantization_only_the_unquantized_variant_runs(model: Path) -> None:
    s = contenders.Settings(model, "float32", 1, 2048, 2, 8)
    spec = contenders.pdserve_server(
        "pdserve co-located", contenders.PDSERVE_QUANTS["none"], s, None, False
    )
    assert "--quantization" not in spec.argv  # older launch: dense weights by default
    with pytest.raises(contenders.MissingQuantizationFlag):
        contenders.pdserve_server(
            "pdserve co-located", contenders.PDSERVE_QUANTS["int4"], s, None, False
        )
    with pytest.raises(contenders.MissingQuantizationFlag):  # `auto` would de-quantize there
        contenders.pdserve_server(
            "pdserve co-located", contenders.PDSERVE_QUANTS["gguf-q4_1"], s, Path("q.gguf"), False
        )


def test_the_int8_input_variant_serves_the_same_gguf_with_its_flag(model: Path) -> None:
    s = contenders.Settings(model, "float32", 1, 2048, 2, 8)
    spec = contenders.pdserve_server(
        "pdserve co-located", contenders.PDSERVE_QUANTS["gguf-q4_1-a8"], s, Path("q.gguf"), True
    )
    argv = " ".join(spec.argv)
    assert "--model q.gguf" in argv and "--quantization auto --gemm-inputs int8" in argv
    assert spec.name == "pdserve co-located GGUF Q4_1 int8 inputs"


def pt(server: str, c: int, tput: float, ttft: float, itl: float) -> Point:
    figures = {"output_throughput": tput, "median_ttft_ms": ttft, "median_itl_ms": itl}
    return Point(server, "random", c, figures, completed=4, failed=0, load_avg=1.0)


def test_ratios_divide_each_pdserve_row_by_each_peer_at_the_same_concurrency() -> None:
    points = [
        pt("vLLM F32", 8, 40, 1000, 100),
        pt("llama.cpp F32", 8, 80, 500, 50),
        pt("pd F32", 8, 40, 1000, 100),
        pt("pd F32", 1, 10, 100, 90),
    ]
    rows = peer_ratio_rows(points, "random", ["pd F32"], ["vLLM F32", "llama.cpp F32"])
    body = [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]
    assert body == [
        ["1", "pd F32", "vLLM F32", "–", "–", "–"],
        ["1", "pd F32", "llama.cpp F32", "–", "–", "–"],
        ["8", "pd F32", "vLLM F32", "1.00", "1.00", "1.00"],
        ["8", "pd F32", "llama.cpp F32", "0.50", "2.00", "2.00"],
    ]


def test_grouped_report_has_a_section_per_precision_and_says_which_peer_failed() -> None:
    report = Report(
        "t",
        "cmd",
        "cpu line",
        ["model: m"],
        [("random", "how")],
        "peers",
        groups=[
            ("F32", ["pd F32"], ["vLLM F32", "llama.cpp F32"]),
            ("Q4_1", ["pd int4"], ["llama.cpp Q4_1"]),
        ],
        peer_failures={"vLLM": "ImportError: no wheel"},
    )
    points = [
        pt("llama.cpp F32", 1, 20, 100, 50),
        pt("pd F32", 1, 10, 200, 100),
        pt("llama.cpp Q4_1", 1, 40, 50, 25),
        pt("pd int4", 1, 20, 100, 50),
    ]
    text = render(report, points)
    assert "vLLM could not run here" in text and "ImportError: no wheel" in text
    f32, q4 = text.split("### F32")[1].split("### Q4_1")
    assert "| 1 | pd F32 | llama.cpp F32 | 0.50 | 2.00 | 2.00 |" in f32
    assert "pd int4" not in f32 and "pd F32" not in q4
    assert "| 1 | pd int4 | llama.cpp Q4_1 | 0.50 | 2.00 | 2.00 |" in q4
    # a results JSON round-trips: groups come back as lists and render the same
    again = Report(**json.loads(json.dumps(report.__dict__, default=list)))
    assert render(again, points) == text


def test_the_4_bit_group_alone_still_has_vllm_in_bfloat16_where_the_cpu_has_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "vector_flags", lambda: ["avx2", "avx512_bf16"])
    (group,) = dry_plan(model, "--precisions", "Q4_1", "--pdserve-quant", "gguf-q4_1")
    assert [s.name for s in group.peers] == ["vLLM BF16", "llama.cpp Q4_1"]
    monkeypatch.setattr(cli, "vector_flags", lambda: ["avx2"])
    (group,) = dry_plan(model, "--precisions", "Q4_1", "--pdserve-quant", "gguf-q4_1")
    assert [s.name for s in group.peers] == ["llama.cpp Q4_1"]


def test_each_gguf_a_server_names_gets_one_roofline_line(tmp_path: Path) -> None:
    from benchmarks.peers.files import roofline

    f = tmp_path / "m.Q4_1.gguf"
    f.write_bytes(b"\0" * 4_000_000)
    lines = roofline(["llama-server", "-m", str(f), "--model", str(f), "-t", "2"])
    assert len(lines) == 1 and "`m.Q4_1.gguf` 4 MB" in lines[0]
    ms = float(lines[0].split(" = ")[1].split(" ms")[0])
    assert ms > 0
    assert roofline(["--model", str(tmp_path)]) == []  # a checkpoint dir: no line
