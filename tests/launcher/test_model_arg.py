"""``--model``: a checkpoint directory, a .gguf file (converted once), or the default model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from frontend.settings import FrontendLaunch
from launcher.args import parse_args
from launcher.cli import _build_topology, _children, _model_path
from launcher.engine_plan import size_kv
from launcher.gpus import assign_gpus
from launcher.settings import ConfigError, KVBackend


def test_a_gguf_file_is_a_model(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert parse_args(["--model", str(path)]).model == path
    with pytest.raises(ConfigError, match="no such GGUF file"):
        parse_args(["--model", str(tmp_path / "missing.gguf")])


def test_an_unsupported_gguf_is_refused_naming_what_is_supported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"'gpt2' is not supported; supported: llama, qwen2"):
        _model_path(parse_args(["--model", str(path)]))


def test_the_frontend_accepts_the_model_path_as_a_name(default_model_path: Path) -> None:
    # Shell completion leaves a trailing slash on a directory; requests may name it so.
    cfg = parse_args(["--device", "cpu", "--model", f"{default_model_path}/"])
    gpus = assign_gpus(cfg, [])
    cfg = size_kv(cfg, default_model_path, gpus, KVBackend.SHM)
    topo = _build_topology(cfg, default_model_path, KVBackend.SHM)
    kids = _children(cfg, topo, gpus, default_model_path, KVBackend.SHM)
    frontend = FrontendLaunch.from_json(
        next(c.spec.settings for c in kids if c.spec.role == "frontend")
    )
    assert frontend.http.model_name == default_model_path.name
    assert frontend.http.model_aliases == (str(default_model_path), f"{default_model_path}/")


def test_int8_gemm_inputs_are_refused_for_dense_weights_and_reach_the_workers(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--gemm-inputs int8`` multiplies packed weights: with ``--quantization none`` it is
    a flag error before any worker starts; with packed weights every engine worker's
    settings carry it (on a CPU with AVX-512 VNNI and BF16; elsewhere a flag error too)."""
    from launcher.engine_plan import serving_dtypes

    dense = parse_args(["--device", "cpu", "--quantization", "none", "--gemm-inputs", "int8"])
    with pytest.raises(ConfigError, match="--gemm-inputs int8 multiplies packed"):
        serving_dtypes(dense, default_model_path, None)
    cfg = parse_args(["--device", "cpu", "--quantization", "int4", "--gemm-inputs", "int8"])
    flags = Path("/proc/cpuinfo").read_text()
    if not all(f in flags.split() for f in ("avx512_vnni", "avx512_bf16")):
        with pytest.raises(ConfigError, match="needs AVX-512 VNNI and BF16"):
            serving_dtypes(cfg, default_model_path, None)
        return
    assert serving_dtypes(cfg, default_model_path, None)[0] == "int4"
    gpus = assign_gpus(cfg, [])
    cfg = size_kv(cfg, default_model_path, gpus, KVBackend.SHM)
    topo = _build_topology(cfg, default_model_path, KVBackend.SHM)
    kids = _children(cfg, topo, gpus, default_model_path, KVBackend.SHM)
    engines = [c.spec.settings for c in kids if c.spec.role in ("prefill", "decode")]
    assert engines and all(s["engine"]["gemm_inputs"] == "int8" for s in engines), engines
