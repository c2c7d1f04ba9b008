"""Weights in the host's shared segment (``engine/checkpoint/shared_weights.py``).

Two runners over one memfd: the first loads the checkpoint and writes the image, the
second maps it; both compute bit for bit what each other does, and within bfloat16
rounding what a private runner does, for every kernel kind (dense, int8, int4, packed
GGUF blocks with their GEMM copies). Every weight tensor of a mapping runner lies inside
the mapping. A segment left unsealed by a killed builder is built again; a sealed one is
read-only; one holding another image is refused and the runner loads a private copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bundled_models import tiny
from engine.build import build_engine
from engine.checkpoint import image
from engine.checkpoint.gguf import convert_gguf
from engine.checkpoint.weights_segment import MAPPING_NAME, create_segment
from engine.config import EngineConfig
from engine.kv.sequence import Sequence
from engine.runner import ModelRunner
from engine.weights import gemm, int4_tiles
from engine.weights.int4_tiles import TilesGemm
from engine.weights.linear import Int4Kernel, Linear
from tests.engine.gguf_files import Q, write_gguf
from wire.params import SamplingParams

PROMPTS = [[9, 70, 11, 187, 0, 42], list(range(100, 133))]


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a prefill of two prompts (the GEMMs) and one decode step (packed)."""
    seqs = [Sequence(i, p, sampling=SamplingParams()) for i, p in enumerate(PROMPTS)]
    out = [runner.prefill([(s, s.num_tokens) for s in seqs])]
    for s in seqs:
        s.output_ids.append(7)
    out.append(runner.decode(seqs))
    return out


def _mapped_ranges() -> list[tuple[int, int]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if MAPPING_NAME in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            out.append((lo, hi))
    return out


def _in_mapping(runner: ModelRunner) -> bool:
    """Whether every weight tensor of ``runner`` lies in a weights mapping."""
    _, tensors = image.export(runner.model)
    ranges = _mapped_ranges()
    return all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in tensors.values())


def _none_mapped(runner: ModelRunner) -> bool:
    """Whether no parameter or buffer of ``runner`` lies in a weights mapping (a private
    runner's GEMM may be prepacked, which ``image.export`` refuses)."""
    ranges = _mapped_ranges()
    held = [*runner.model.parameters(), *runner.model.buffers()]
    return not any(lo <= t.data_ptr() < hi for t in held for lo, hi in ranges)


@pytest.fixture
def segment() -> Iterator[int]:
    """A fresh weights segment's fd, closed after the test."""
    fd = create_segment()
    yield fd
    os.close(fd)


@pytest.fixture(scope="module")
def gguf_q4_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("q4_1")
    path = write_gguf(tiny.tiny_model_dir("llama"), tmp / "m.gguf", Q.Q4_1, vocab=False)
    convert_gguf(path, tmp / "hf")
    return tmp / "hf"


@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "gguf", "gguf+a8"])
def test_a_mapped_runner_computes_what_the_builder_and_a_private_one_do(
    quantization: str, gguf_q4_1: Path, segment: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``gguf+a8``: the GEMM is ``A8Gemm`` on the packed tiles (``--gemm-inputs int8``),
    which an image holds nothing more for."""
    quantization, _, a8 = quantization.partition("+")
    if a8 and not int4_tiles.a8_supported():
        pytest.skip("the int8-input GEMM does not run here")
    model = gguf_q4_1 if quantization == "gguf" else tiny.tiny_model_dir(tiny.DEFAULT_ARCH)
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=16,
        quantization="auto" if quantization == "gguf" else quantization,
        large_batch_gemm=True,
        gemm_min_rows=4,  # the prefill's rows take the GEMM, the decode's two stay packed
        gemm_inputs="int8" if a8 else "bfloat16",
        weights_fd=segment,
    )
    with caplog.at_level("INFO"):
        builder = build_engine(config).runner
        mapped = build_engine(config).runner
    assert sum("weights written to" in r.message for r in caplog.records) == 1
    assert sum("weights mapped from" in r.message for r in caplog.records) == 1
    assert builder.quantization == quantization
    assert _in_mapping(builder) and _in_mapping(mapped)
    if a8:  # every layer's GEMM, not the LM head's (bfloat16: see the loader)
        gemms = {
            name: getattr(m.kernel, "many_rows", None)
            for name, m in mapped.model.named_modules()
            if isinstance(m, Linear) and name != "lm_head"
        }
        assert gemms and all(
            r is not None and isinstance(r.gemm, int4_tiles.A8Gemm) for r in gemms.values()
        ), gemms
    private = build_engine(replace(config, weights_fd=None)).runner
    assert _none_mapped(private)
    got, built, want = _steps(mapped), _steps(builder), _steps(private)
    for g, b, w in zip(got, built, want, strict=True):
        assert torch.equal(g, b)
        # The private runner's GEMM may be oneDNN's prepacked one: same math, and on
        # the CPUs measured the same bits; allow bfloat16 accumulation order elsewhere.
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)


def test_an_unsealed_segment_is_built_again_and_a_sealed_one_is_read_only(
    segment: int, caplog: pytest.LogCaptureFixture
) -> None:
    os.write(segment, b"what a builder killed half-way leaves" * 1000)
    config = EngineConfig(
        model=str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH)), num_kv_blocks=16, weights_fd=segment
    )
    with caplog.at_level("INFO"):
        runner = build_engine(config).runner
    assert any("weights written to" in r.message for r in caplog.records)
    assert _in_mapping(runner)
    with pytest.raises(PermissionError):
        os.pwrite(segment, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(segment, 1)


def test_a_segment_holding_another_image_is_refused_and_the_runner_loads_privately(
    segment: int, caplog: pytest.LogCaptureFixture
) -> None:
    model = str(tiny.tiny_model_dir(tiny.DEFAULT_ARCH))
    build_engine(
        EngineConfig(model=model, num_kv_blocks=16, quantization="int8", weights_fd=segment)
    )
    config = EngineConfig(model=model, num_kv_blocks=16, quantization="int4", weights_fd=segment)
    with caplog.at_level("ERROR"):
        other = build_engine(config).runner
    assert any("weights not shared" in r.message for r in caplog.records)
    assert _none_mapped(other)
    private = build_engine(replace(config, weights_fd=None)).runner
    for g, w in zip(_steps(other), _steps(private), strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("layout", ["tiles", "vnni", "torch-only"])
def test_the_many_rows_gemm_is_shared_in_the_layout_this_cpu_runs(
    layout: str, gguf_q4_1: Path, segment: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the AMX int4 kernel the many-rows GEMM reads the packed layers' own tiles (no
    copy); on torch's int4 kernel, where the kernel library's bfloat16 GEMM loads, the
    segment holds its VNNI-packed weights; else (or with the library off) the plain ones,
    on torch's GEMM."""
    library = layout == "vnni"
    if layout == "tiles" and "amx" not in int4_tiles.available_kernels():
        pytest.skip("the AMX int4 kernel does not run here")
    monkeypatch.setenv("PDSERVE_INT4_KERNEL", "amx" if layout == "tiles" else "torch")
    if library and not gemm.vnni_supported():
        pytest.skip("the kernel library's bfloat16 GEMM does not load here")
    if layout == "torch-only":
        monkeypatch.setattr(gemm, "vnni_supported", lambda: False)
        monkeypatch.setattr(image, "vnni_supported", lambda: False)
    config = EngineConfig(
        model=str(gguf_q4_1),
        num_kv_blocks=16,
        large_batch_gemm=True,
        gemm_min_rows=4,
        weights_fd=segment,
    )
    builder, mapped = build_engine(config).runner, build_engine(config).runner
    assert _in_mapping(mapped)
    want = {"tiles": TilesGemm, "vnni": gemm.VnniGemm, "torch-only": gemm.PlainGemm}[layout]
    kernels = [m.kernel for m in mapped.model.modules() if isinstance(m, Linear)]
    held = [k.many_rows.gemm for k in kernels if getattr(k, "many_rows", None)]
    assert held and all(isinstance(g, want) for g in held)
    if layout == "tiles":  # the very bytes the packed kernel reads
        for k in kernels:
            if isinstance(k, Int4Kernel) and k.many_rows is not None:
                assert k.many_rows.gemm.tiles.data_ptr() == k.tiles.data_ptr()
    for g, b in zip(_steps(mapped), _steps(builder), strict=True):
        assert torch.equal(g, b)
